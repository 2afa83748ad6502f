"""Queue benchmark: the same workload in process and through RabbitMQ + worker + PostgreSQL.

    python ops/bench/pipeline.py                     # 64 requests, then the 1-token ceiling
    python ops/bench/pipeline.py -n 128 --ceiling 3000

1. In process: `kvflow run-batch`'s path (engine driven directly, no broker, no database).
2. Through the queue: a `kvflow worker` subprocess with the same engine settings, every
   request published at once by `broker.Client`, results awaited from the reply queue,
   rows in a fresh PostgreSQL schema. Output tok/s from the first publish to the last
   result; the target is at least 90% of the in-process figure.
3. The pipeline's ceiling: many requests of one prompt token and max_tokens=1 through the
   queue, requests per second (target: at least 200 here); once with the default model,
   and once with a 2-layer random model of the same vocabulary, which takes the model's
   cost out and leaves the pipeline's own (broker, worker, ledger, replies).
Writes JSON, a Markdown table and a PNG under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import Workload, make_workload

from broker.client import Client
from worker.batch import BatchItem, run_items
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.ledger import migrate
from worker.openai_format import ParsedBody
from worker.request import SamplingParams, percentile


def in_process(engine: LLMEngine, wl: Workload) -> dict[str, float]:
    items = [
        BatchItem(
            line_no=i,
            custom_id=f"r{i}",
            parsed=ParsedBody(
                "completion", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), 0
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
) -> dict[str, float]:
    """Publish every request at once, await every result. With `worker_pid`, also the
    CPU milliseconds per request of each party (key `cpu_ms_per_req`)."""
    cpu0 = cpu_seconds(worker_pid) if worker_pid is not None else {}
    async with await Client.connect(amqp_url, queue=queue) as client:
        t0 = time.time()
        handles = await asyncio.gather(
            *(
                client.submit(prompt_token_ids=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                for p, m in zip(prompts, max_tokens, strict=True)
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
    RabbitMQ, PostgreSQL, this benchmark (the producer) and the rest (Linux /proc)."""
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
            who = "other (kernel, ...)"
        out[who] = out.get(who, 0.0) + used
    return out


def tiny_model(out: Path) -> Path:
    """A 2-layer random model with the default model's tokenizer (its cost is ~nothing)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from worker.model.gguf import cached_conversion, default_model_path

    src = cached_conversion(default_model_path())
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def start_worker(
    args: argparse.Namespace, queue: str, db_url: str, model: str | None
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", "--num-requests", type=int, default=64)
    ap.add_argument("--ceiling", type=int, default=2000, help="requests for the max_tokens=1 run")
    ap.add_argument("--rounds", type=int, default=3, help="alternating in-process / queue rounds")
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
    args.out.mkdir(parents=True, exist_ok=True)

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    wl = make_workload(
        engine.tokenizer,
        args.num_requests,
        seed=1,
        prompt_range=(16, 256),
        output_range=(8, 256),
        output_median=48,
    )
    print(f"workload: {wl.describe()}", file=sys.stderr)
    run_items(
        engine,
        [
            BatchItem(
                0,
                "w",
                parsed=ParsedBody("completion", wl.prompts[0], SamplingParams(max_tokens=2), 0),
            )
        ],
        progress=False,
    )

    def with_worker(
        model: str | None,
        runs: list[tuple[list[list[int]], list[int], str]],
        before: Callable[[Callable[[], dict[str, float]]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Start a worker on `model`, call `before(run_the_workload)`, then do `runs`."""
        schema, db_url = asyncio.run(fresh_schema(args.database_url))
        migrate.upgrade(db_url)
        queue = f"bench.{uuid.uuid4().hex[:8]}"
        proc = start_worker(args, queue, db_url, model)
        try:
            asyncio.run(wait_ready(db_url, proc))
            asyncio.run(through_queue(args.amqp_url, queue, wl.prompts[:2], [2, 2], "warm-up"))
            if before is not None:
                before(
                    lambda: asyncio.run(
                        through_queue(args.amqp_url, queue, wl.prompts, wl.output_lens, "queue")
                    )
                )
            return [
                asyncio.run(through_queue(args.amqp_url, queue, p, m, d, worker_pid=proc.pid))
                for p, m, d in runs
            ]
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            asyncio.run(drop_schema(args.database_url, schema))

    ones = ([[1]] * args.ceiling, [1] * args.ceiling)
    # In-process and queue runs alternate, the worker idle while the engine runs here:
    # this machine's noise is about +-10% run to run, so medians of rounds are compared.
    locals_: list[dict[str, float]] = []
    queues: list[dict[str, float]] = []

    def a_b_rounds(through: Callable[[], dict[str, float]]) -> None:
        for r in range(args.rounds):
            locals_.append(in_process(engine, wl))
            queues.append(through())
            print(
                f"round {r + 1}: in process {locals_[-1]['output_tok_s']:.1f} tok/s, "
                f"queue {queues[-1]['output_tok_s']:.1f} tok/s",
                file=sys.stderr,
            )

    ceiling = with_worker(args.model, [(*ones, "ceiling")], a_b_rounds)[0]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (ceiling_tiny,) = with_worker(str(tiny_model(Path(tmp))), [(*ones, "ceiling, tiny model")])
    local = _median(locals_)
    queued = _median(queues)
    ratio = queued["output_tok_s"] / local["output_tok_s"]
    rows = [
        "| path | output tok/s | wall (s) | TTFT p50 / p99 (s) | e2e p50 / p99 (s) |",
        "|---|---:|---:|---:|---:|",
        f"| in process (run-batch) | {local['output_tok_s']:.1f} | {local['wall_s']:.1f} | {local['ttft_p50']:.2f} / {local['ttft_p99']:.2f} | {local['e2e_p50']:.2f} / {local['e2e_p99']:.2f} |",
        f"| RabbitMQ + worker + PostgreSQL | {queued['output_tok_s']:.1f} | {queued['wall_s']:.1f} | {queued['ttft_p50']:.2f} / {queued['ttft_p99']:.2f} | {queued['e2e_p50']:.2f} / {queued['e2e_p99']:.2f} |",
    ]
    md = "\n".join(rows) + (
        f"\n\nrounds (output tok/s): in process {_figures(locals_)}; "
        f"queue {_figures(queues)} (medians in the table)\n"
        f"queue path / in process: {ratio:.1%} of output tok/s (target >= 90%)\n"
        f"pipeline ceiling (max_tokens=1, a 1-token prompt, {args.ceiling} requests; target >= 200 req/s):\n"
        f"- default model: {ceiling['req_s']:.0f} requests/s\n"
        f"- 2-layer model (the pipeline's own cost): {ceiling_tiny['req_s']:.0f} requests/s\n"
        f"\nCPU per request in the ceiling runs (ms; {os.cpu_count()} cores shared by all):\n\n"
        + _cpu_table({"default model": ceiling, "2-layer model": ceiling_tiny})
    )
    print("\n" + md)
    (args.out / "pipeline.md").write_text(md)
    (args.out / "pipeline.json").write_text(
        json.dumps(
            {
                "in_process": local,
                "queue": queued,
                "ceiling": ceiling,
                "ceiling_tiny": ceiling_tiny,
                "ratio": ratio,
            },
            indent=2,
        )
    )
    plot(local, queued, ceiling, ceiling_tiny, args.out / "pipeline.png")


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


def _figures(runs: list[dict[str, float]]) -> str:
    return ", ".join(f"{r['output_tok_s']:.1f}" for r in runs)


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median output tok/s (its other figures come with it)."""
    ordered = sorted(runs, key=lambda r: r["output_tok_s"])
    return {**ordered[len(ordered) // 2], "rounds": [r["output_tok_s"] for r in runs]}  # type: ignore[dict-item]


def plot(
    local: dict[str, float],
    queued: dict[str, float],
    ceiling: dict[str, float],
    ceiling_tiny: dict[str, float],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(
        ["in process", "through the queue"],
        [local["output_tok_s"], queued["output_tok_s"]],
        color=["#2a7", "#27a"],
    )
    a.set_ylabel("output tokens / s")
    a.set_title(
        f"same workload: queue = {queued['output_tok_s'] / local['output_tok_s']:.0%} of in process"
    )
    b.bar(
        ["default model", "2-layer model"],
        [ceiling["req_s"], ceiling_tiny["req_s"]],
        color=["#a72", "#c95"],
    )
    b.axhline(200, color="k", linestyle="--", label="target 200 req/s")
    b.set_ylabel("requests / s")
    b.set_title("pipeline ceiling: max_tokens=1")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
