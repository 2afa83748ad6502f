"""Queue benchmark: the same workload in process and through RabbitMQ + worker + PostgreSQL.

    python ops/bench/pipeline.py                          # everything (~15 min here)
    python ops/bench/pipeline.py --stages echo,ceiling-tiny  # the floor and the 2-layer ceiling

1. The echo floor (ops/bench/echo.py): the simplest fast aio-pika consumer (prefetch
   window, reply, ack; no engine, no ledger) under the same producer; measured in runs
   alternating with the 2-layer worker's (--repeat, medians reported).
2. The pipeline's ceiling: many requests of one prompt token and max_tokens=1 through a
   `kvflow worker`, requests per second and CPU per request by party; with a 2-layer
   random model of the default vocabulary (the model's cost out: the pipeline's own),
   the same in fair mode (`--policy fair`: the router moves each message into its
   client's lane queue; the broker's extra cost per request shows in the CPU table), and
   with the default model.
3. The engine process alone (ops/bench/stepcost.py): its step loop's cost per one-token
   request, fed in bursts of 4, 64 and 256 requests per step.
4. Long outputs (a few hundred tokens each) in process (`kvflow run-batch`'s path) and
   through RabbitMQ + worker + PostgreSQL, in alternating rounds; the medians compared.
Every request is published at once by `broker.Client`, results awaited from its reply
queue, rows in a fresh PostgreSQL schema. Writes JSON, Markdown and a PNG under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
FAIR_CLIENTS = ("a", "b")  # fair mode's clients: equal weights, requests alternating
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import Workload, make_workload

from broker.client import Client
from worker.batch import BatchItem, run_items
from worker.builder import EngineRequest
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.ledger import migrate
from worker.request import SamplingParams, percentile
from worker.serving.lanes import OTHER, lane_queue


def in_process(engine: LLMEngine, wl: Workload) -> dict[str, float]:
    items = [
        BatchItem(
            line_no=i,
            custom_id=f"r{i}",
            request_id=f"r{i}",
            kind="completion",
            request=EngineRequest(
                f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            ),
        )
        for i, (p, m) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))
    ]
    s = run_items(engine, items, progress=True)
    return {
        "output_tok_s": s.output_tok_s,
        "wall_s": s.wall_s,
        "ttft_p50": percentile(sorted(s.ttft), 50),
        "ttft_p99": percentile(sorted(s.ttft), 99),
        "e2e_p50": percentile(sorted(s.e2e), 50),
        "e2e_p99": percentile(sorted(s.e2e), 99),
    }


async def through_queue(
    amqp_url: str,
    queue: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    desc: str,
    worker_pid: int | None = None,
    clients: Sequence[str] = ("default",),
) -> dict[str, float]:
    """Publish every request at once, await every result; request i is accounted to
    client `clients[i % len(clients)]`. With `worker_pid`, also the CPU milliseconds per
    request of each party (key `cpu_ms_per_req`)."""
    cpu0 = cpu_seconds(worker_pid) if worker_pid is not None else {}
    async with await Client.connect(amqp_url, queue=queue) as client:
        t0 = time.time()
        handles = await asyncio.gather(
            *(
                client.submit(
                    prompt_token_ids=p,
                    max_tokens=m,
                    temperature=0.0,
                    ignore_eos=True,
                    client=clients[i % len(clients)],
                )
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
            )
        )
        published = time.time()
        results = []
        with tqdm(total=len(handles), desc=desc, unit="req", file=sys.stderr) as bar:
            for fut in asyncio.as_completed([h.result(timeout=3600) for h in handles]):
                results.append(await fut)
                bar.update(1)
        wall = time.time() - t0
    cpu_ms: dict[str, float] = {}
    if worker_pid is not None:
        cpu1 = cpu_seconds(worker_pid)
        cpu_ms = {k: (v - cpu0.get(k, 0.0)) * 1000 / len(results) for k, v in cpu1.items()}
    out_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = sorted(r["timing"]["ttft_s"] for r in results)
    e2e = sorted(r["timing"]["e2e_s"] for r in results)
    return {
        "cpu_ms_per_req": cpu_ms,
        "output_tok_s": out_tokens / wall,
        "req_s": len(results) / wall,
        "wall_s": wall,
        "publish_s": published - t0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
    }


def cpu_seconds(worker_pid: int) -> dict[str, float]:
    """CPU seconds used so far, by party: the worker's event loop, its engine process,
    RabbitMQ, PostgreSQL, this benchmark (the producer), and the rest of the machine
    (from /proc/stat's total, so processes that come and go count there)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid = int(stat.parent.name)
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        ppid, used = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        if pid == worker_pid:
            who = "worker (event loop)"
        elif ppid == worker_pid:
            who = "worker (engine)"
        elif pid == os.getpid():
            who = "producer (this benchmark)"
        elif comm.startswith("beam"):
            who = "RabbitMQ"
        elif comm.startswith("postgres"):
            who = "PostgreSQL"
        else:
            continue
        out[who] = out.get(who, 0.0) + used
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    busy = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    total = (sum(busy) - busy[3] - busy[4]) / tick
    out["other (kernel, other processes)"] = total - sum(out.values())
    return out


def tiny_model(out: Path) -> Path:
    """A 2-layer random model with the default model's tokenizer (its cost is ~nothing)."""
    from models import random_llama

    return random_llama(
        out,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )


def start_worker(
    args: argparse.Namespace,
    queue: str,
    db_url: str,
    model: str | None,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "worker.cli",
        "worker",
        "--queue",
        queue,
        "--database-url",
        db_url,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--log-level",
        "WARNING",
    ]
    if model:
        cmd += ["--model", model]
    cmd += extra
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


async def wait_ready(db_url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    from sqlalchemy import text

    engine = migrate.open_engine(db_url)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with code {proc.returncode}")
            async with engine.connect() as conn:
                n = (
                    await conn.execute(text("select count(*) from workers where state = 'serving'"))
                ).scalar()
            if n:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError("worker did not become ready")
    finally:
        await engine.dispose()


async def fresh_schema(base_url: str) -> tuple[str, str]:
    import asyncpg

    schema = f"kvflow_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(base_url.replace("postgresql+asyncpg://", "postgresql://"))
    await conn.execute(f"create schema {schema}")
    await conn.close()
    sep = "&" if "?" in base_url else "?"
    return schema, f"{base_url}{sep}options=-csearch_path%3D{schema}"


async def drop_schema(base_url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(base_url.replace("postgresql+asyncpg://", "postgresql://"))
    await conn.execute(f"drop schema if exists {schema} cascade")
    await conn.close()


async def drop_queues(amqp_url: str, *names: str) -> None:
    """Delete the benchmark's queues once their consumer is gone (each run makes new ones)."""
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    async with connection:
        for name in names:
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.ChannelClosed):
                await channel.queue_delete(name)  # a queue never declared closes the channel


def start_echo(args: argparse.Namespace, queue: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(Path(__file__).with_name("echo.py")), "--queue", queue]
    cmd += ["--prefetch", str(args.max_num_seqs + 2), "--amqp-url", args.amqp_url]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError("the echo consumer did not start")
    return proc


def cpu_model() -> str:
    """The CPU's model name and its bfloat16 support, as lscpu shows them."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "").split()
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return f"{name}, {os.cpu_count()} CPUs, {'with' if bf16 else 'without'} native bfloat16"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", "--num-requests", type=int, default=16, help="long-output requests")
    ap.add_argument("--output-tokens", type=int, default=256, help="median output length")
    ap.add_argument("--ceiling", type=int, default=3000, help="requests for the max_tokens=1 runs")
    ap.add_argument("--rounds", type=int, default=5, help="alternating in-process / queue rounds")
    ap.add_argument(
        "--repeat", type=int, default=3, help="alternating echo floor / 2-layer worker runs"
    )
    ap.add_argument(
        "--stages",
        default="echo,ceiling-tiny,ceiling-fair,ceiling,engine,rounds",
        help="which of echo, ceiling-tiny, ceiling-fair, ceiling, engine, rounds to run "
        "(comma-separated)",
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--amqp-url",
        default=os.environ.get("KVFLOW_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    ap.add_argument(
        "--database-url",
        default=os.environ.get(
            "KVFLOW_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    ones = ([[1]] * args.ceiling, [1] * args.ceiling)
    results: dict[str, Any] = {"cpu": cpu_model()}
    print(f"CPU: {results['cpu']}", file=sys.stderr)

    def with_worker(
        model: str | None, run: Callable[[str, int], dict[str, Any]], extra: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Start a worker on `model` (with `extra` flags) and a fresh ledger schema, warm
        it up, `run(queue, worker pid)`, stop it."""
        schema, db_url = asyncio.run(fresh_schema(args.database_url))
        migrate.upgrade(db_url)
        queue = f"bench.{uuid.uuid4().hex[:8]}"
        proc = start_worker(args, queue, db_url, model, extra)
        try:
            asyncio.run(wait_ready(db_url, proc))
            asyncio.run(through_queue(args.amqp_url, queue, [[1]] * 64, [1] * 64, "warm-up"))
            return run(queue, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            asyncio.run(drop_schema(args.database_url, schema))
            lanes = [lane_queue(queue, c) for c in (*FAIR_CLIENTS, OTHER)]  # fair mode's
            asyncio.run(drop_queues(args.amqp_url, queue, f"{queue}.dead", *lanes))

    def ceiling(queue: str, pid: int, desc: str, clients: Sequence[str] = ("default",)) -> Any:
        return asyncio.run(
            through_queue(args.amqp_url, queue, *ones, desc, worker_pid=pid, clients=clients)
        )

    if stages & {"echo", "ceiling-tiny"}:
        results.update(floor_and_tiny(args, stages, with_worker, ceiling))
    if "ceiling-fair" in stages:
        import tempfile

        # Fair mode: the router moves each message into its client's lane queue (one more
        # publish with confirm and ack per request), the intake pulls the lanes in fair
        # order. Two clients with equal weights, requests alternating.
        with tempfile.TemporaryDirectory() as tmp:
            results["ceiling_fair"] = with_worker(
                str(tiny_model(Path(tmp))),
                lambda q, pid: ceiling(q, pid, "2-layer model, fair mode", FAIR_CLIENTS),
                ["--policy", "fair", "--client-weights", ",".join(f"{c}=1" for c in FAIR_CLIENTS)],
            )
    if "ceiling" in stages:
        results["ceiling"] = with_worker(
            args.model, lambda q, pid: ceiling(q, pid, "default model")
        )
    if "engine" in stages:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            results["engine"] = engine_step_cost(str(tiny_model(Path(tmp))), args.ceiling)
    if "rounds" in stages:
        results.update(long_output_rounds(args, with_worker))
    md = report(results, args)
    print("\n" + md)
    (args.out / "pipeline.md").write_text(md)
    (args.out / "pipeline.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "pipeline.png")


def floor_and_tiny(
    args: argparse.Namespace,
    stages: set[str],
    with_worker: Callable[..., dict[str, Any]],
    ceiling: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """The echo floor and the 2-layer worker measured in alternating runs (both consumers
    up, each on its own queue, one served at a time): the machine's noise moves both
    alike, and each is reported by its run with the median requests/s."""
    import tempfile

    echoes: list[dict[str, Any]] = []
    tinies: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        echo = stack.enter_context(echo_running(args)) if "echo" in stages else None

        def runs(queue: str | None, pid: int | None) -> dict[str, Any]:
            for r in range(args.repeat):
                if echo is not None:
                    echoes.append(ceiling(*echo, f"echo floor {r + 1}/{args.repeat}"))
                if queue is not None:
                    tinies.append(ceiling(queue, pid, f"2-layer model {r + 1}/{args.repeat}"))
            return {}

        if "ceiling-tiny" in stages:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            with_worker(str(tiny_model(Path(tmp))), runs)
        else:
            runs(None, None)
    out: dict[str, Any] = {}
    if echoes:
        out["echo"] = _median(echoes, "req_s", "runs_req_s")
    if tinies:
        out["ceiling_tiny"] = _median(tinies, "req_s", "runs_req_s")
    if echoes and tinies:
        out["tiny_shares"] = [t["req_s"] / e["req_s"] for e, t in zip(echoes, tinies, strict=True)]
    return out


@contextlib.contextmanager
def echo_running(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """The echo consumer on a queue of its own, warmed up: (queue, pid)."""
    queue = f"bench.{uuid.uuid4().hex[:8]}"
    echo = start_echo(args, queue)
    try:
        asyncio.run(through_queue(args.amqp_url, queue, [[1]] * 64, [1] * 64, "warm-up"))
        yield queue, echo.pid
    finally:
        echo.terminate()
        echo.wait(30)
        asyncio.run(drop_queues(args.amqp_url, queue, f"{queue}.dead"))


def engine_step_cost(model: str, n: int) -> list[dict[str, Any]]:
    """ops/bench/stepcost.py on `model`, in a process of its own started as the worker
    starts its engine process (idle OpenMP threads do not spin)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stepcost.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GOMP_SPINCOUNT": "1000"}
        cmd = [sys.executable, str(ROOT / "ops/bench/stepcost.py"), "--model", model]
        subprocess.run(
            [*cmd, "-n", str(n), "--json", str(out)], env=env, check=True, stdout=subprocess.DEVNULL
        )
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def long_output_rounds(
    args: argparse.Namespace, with_worker: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """The same long-output workload in process and through the queue, in alternating
    rounds (the worker idle while the engine runs here): this machine's noise is about
    +-10% run to run, so the medians of the rounds are compared."""
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    median = args.output_tokens
    wl = make_workload(
        engine.tokenizer,
        args.num_requests,
        seed=1,
        prompt_range=(16, 256),
        output_range=(median // 2, median * 2),
        output_median=median,
    )
    print(f"workload: {wl.describe()}", file=sys.stderr)
    locals_: list[dict[str, float]] = []
    queues: list[dict[str, float]] = []

    def rounds(queue: str, pid: int) -> dict[str, Any]:
        for r in range(args.rounds):
            locals_.append(in_process(engine, wl))
            queues.append(
                asyncio.run(
                    through_queue(args.amqp_url, queue, wl.prompts, wl.output_lens, "queue")
                )
            )
            print(
                f"round {r + 1}: in process {locals_[-1]['output_tok_s']:.1f} tok/s, "
                f"queue {queues[-1]['output_tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
        return {}

    with_worker(args.model, rounds)
    local, queued = _median(locals_), _median(queues)
    return {
        "workload": wl.describe(),
        "in_process": local,
        "queue": queued,
        "ratio": queued["output_tok_s"] / local["output_tok_s"],
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"CPU: {results['cpu']}", ""]
    ceilings = {
        name: results[key]
        for key, name in (
            ("echo", "echo floor (aio-pika consumer, no engine, no ledger)"),
            ("ceiling_tiny", "kvflow worker, 2-layer model"),
            ("ceiling_fair", "kvflow worker, 2-layer model, fair mode (router + lanes)"),
            ("ceiling", "kvflow worker, default model"),
        )
        if key in results
    }
    if ceilings:
        floor = results.get("echo", {}).get("req_s")
        lines += [
            f"Ceiling: {args.ceiling} requests of one prompt token with max_tokens 1, "
            "published at once with confirms (targets: 2-layer >= 50% of the echo floor and "
            ">= 300 req/s; default model >= 150 req/s). The echo floor and the 2-layer "
            "worker: the median of alternating runs (all runs and each round's share below).",
            "",
            "| consumer | requests/s | of the echo floor |",
            "|---|---:|---:|",
        ]
        for name, r in ceilings.items():
            share = f"{r['req_s'] / floor:.0%}" if floor else "-"
            lines.append(f"| {name} | {r['req_s']:.0f} | {share} |")
        if "tiny_shares" in results:
            echo_runs = ", ".join(f"{x:.0f}" for x in results["echo"]["runs_req_s"])
            tiny_runs = ", ".join(f"{x:.0f}" for x in results["ceiling_tiny"]["runs_req_s"])
            shares = ", ".join(f"{x:.0%}" for x in results["tiny_shares"])
            lines += [
                "",
                f"Runs (requests/s): echo floor {echo_runs}; 2-layer worker {tiny_runs}; "
                f"its share of the echo floor, round by round: {shares}.",
            ]
        lines += [
            "",
            "CPU per request by party (ms; all parties share the CPUs; target: the worker's "
            "event loop <= 1 ms):",
            "",
            _cpu_table(ceilings),
        ]
        tiny = results.get("ceiling_tiny")
        if tiny:
            loop_ms = tiny["cpu_ms_per_req"].get("worker (event loop)", 0.0)
            if loop_ms > 0:
                lines.append(
                    f"A GPU worker's ceiling: its event loop needs {loop_ms:.2f} ms of one core "
                    f"per request, so one worker tops out near {1000 / loop_ms:.0f} requests/s "
                    "whatever the accelerator (the engine process and the broker need cores "
                    "of their own on top).\n"
                )
    if "engine" in results:
        from ops.bench.stepcost import table

        lines += [
            "The engine process alone (2-layer model; its step loop fed bursts of one-token "
            "requests, ops/bench/stepcost.py): the cost per request of a step's fixed part "
            "(small bursts) and of its per-request bookkeeping (large ones):",
            "",
            table(results["engine"]),
        ]
    if "ratio" in results:
        local, queued = results["in_process"], results["queue"]
        lines += [
            f"Long outputs ({results['workload']}), median of {args.rounds} alternating rounds:",
            "",
            "| path | output tok/s | wall (s) | TTFT p50 / p99 (s) | e2e p50 / p99 (s) |",
            "|---|---:|---:|---:|---:|",
            f"| in process (run-batch) | {local['output_tok_s']:.1f} | {local['wall_s']:.1f} | {local['ttft_p50']:.2f} / {local['ttft_p99']:.2f} | {local['e2e_p50']:.2f} / {local['e2e_p99']:.2f} |",
            f"| RabbitMQ + worker + PostgreSQL | {queued['output_tok_s']:.1f} | {queued['wall_s']:.1f} | {queued['ttft_p50']:.2f} / {queued['ttft_p99']:.2f} | {queued['e2e_p50']:.2f} / {queued['e2e_p99']:.2f} |",
            "",
            f"rounds (output tok/s): in process {_figures(local)}; queue {_figures(queued)}",
            f"queue path / in process: {results['ratio']:.1%} (target >= 95%)",
        ]
    return "\n".join(lines) + "\n"


def _cpu_table(runs: dict[str, dict[str, Any]]) -> str:
    cpu: dict[str, dict[str, float]] = {k: r["cpu_ms_per_req"] for k, r in runs.items()}
    parties = sorted(
        {p for c in cpu.values() for p in c}, key=lambda p: -max(c.get(p, 0) for c in cpu.values())
    )
    lines = ["| party | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    for p in parties:
        lines.append(f"| {p} | " + " | ".join(f"{cpu[k].get(p, 0.0):.2f}" for k in runs) + " |")
    lines.append(
        "| **total** | " + " | ".join(f"**{sum(cpu[k].values()):.2f}**" for k in runs) + " |"
    )
    return "\n".join(lines) + "\n"


def _figures(median: dict[str, Any]) -> str:
    return ", ".join(f"{x:.1f}" for x in median["rounds"])


def _median(
    runs: list[dict[str, Any]], key: str = "output_tok_s", every: str = "rounds"
) -> dict[str, Any]:
    """The run with the median `key` (its other figures, CPU split included, come with
    it), and every run's `key` in run order under `every`."""
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], every: [r[key] for r in runs]}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = {
        "echo": "echo floor",
        "ceiling_tiny": "2-layer",
        "ceiling_fair": "2-layer, fair",
        "ceiling": "default model",
    }
    shown = [k for k in names if k in results]
    a.bar([names[k] for k in shown], [results[k]["req_s"] for k in shown], color="#a72")
    a.axhline(300, color="k", linestyle="--", label="target 300 req/s (2-layer)")
    a.set_ylabel("requests / s")
    a.set_title("ceiling: max_tokens=1")
    a.legend()
    if "ratio" in results:
        local, queued = results["in_process"], results["queue"]
        rounds = range(1, len(local["rounds"]) + 1)
        b.plot(rounds, local["rounds"], "o-", label="in process")
        b.plot(rounds, queued["rounds"], "s-", label="through the queue")
        b.set_xlabel("round")
        b.set_ylabel("output tokens / s")
        b.set_title(f"long outputs: queue = {results['ratio']:.0%} of in process (median)")
        b.legend()
    fig.suptitle(results["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
