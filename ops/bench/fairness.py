"""Scheduling policy, measured: FIFO against fair share between two clients, and the mix of
prefill and decode.

1. Two clients through RabbitMQ + a worker + PostgreSQL: client A publishes a backlog ten
   times larger than client B's, then B publishes. Once with the worker in FIFO order
   (one queue, fcfs), once in fair mode (lanes per client, the Virtual Token Counter
   policy). Per client: TTFT and queue delay (p50 / p99), output tokens per second over
   its own busy span, and the CPU per request of the broker and the worker (fair mode's
   router moves every message once more: its broker cost per request).
2. The prefill/decode mix, in process: requests decoding while long prompts arrive, under
   decode-first, chunked and prefill-first: TTFT of the new prompts and inter-token
   latency of the running requests.

    python ops/bench/fairness.py --out ops/bench/results     # ~5 min here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import cpu_model, cpu_seconds, drop_schema, fresh_schema, wait_ready
from tqdm import tqdm

from broker.client import Client
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.ledger import migrate
from worker.request import SamplingParams, percentile


def start_worker(args: argparse.Namespace, queue: str, db_url: str, fair: bool) -> Any:
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--queue", queue]
    cmd += ["--database-url", db_url, "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--log-level", "WARNING"]
    if fair:
        cmd += ["--policy", "fair", "--client-weights", "a=1,b=1"]
    return subprocess.Popen(cmd, cwd=ROOT)


async def two_clients(args: argparse.Namespace, queue: str, pid: int) -> dict[str, Any]:
    """A's backlog, then B's few requests; results per client."""
    prompt = list(range(100, 100 + args.prompt_tokens))
    cpu0 = cpu_seconds(pid)
    async with await Client.connect(args.amqp_url, queue=queue) as client:
        t0 = time.time()
        sent: dict[str, list[Any]] = {"a": [], "b": []}
        for n, name in ((args.backlog, "a"), (args.backlog // 10, "b")):
            for _ in range(n):
                handle = await client.submit(
                    prompt_token_ids=prompt,
                    max_tokens=args.output_tokens,
                    ignore_eos=True,
                    client=name,
                )
                sent[name].append(handle)
            if name == "a":
                await asyncio.sleep(args.b_after_s)  # A's backlog is queued first
        results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        total = sum(len(v) for v in sent.values())
        with tqdm(total=total, desc="two clients", unit="req", file=sys.stderr) as bar:
            for name, handles in sent.items():
                for h in handles:
                    results[name].append(await h.result(timeout=3600))
                    bar.update(1)
    cpu1 = cpu_seconds(pid)
    cpu = {k: (v - cpu0.get(k, 0.0)) * 1000 / total for k, v in cpu1.items()}
    out: dict[str, Any] = {"cpu_ms_per_req": cpu}
    for name, rs in results.items():
        ttft = sorted(r["timing"]["ttft_s"] for r in rs)
        queue_s = sorted(r["timing"]["queue_s"] for r in rs)
        first = min(r["timing"]["enqueued_at"] for r in rs)
        last = max(r["timing"]["finished_at"] for r in rs)
        tokens = sum(r["usage"]["completion_tokens"] for r in rs)
        out[name] = {
            "requests": len(rs),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "queue_p50": percentile(queue_s, 50),
            "queue_p99": percentile(queue_s, 99),
            "tok_s": tokens / max(last - first, 1e-9),
            "done_s": last - t0,
        }
    return out


def through_worker(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    schema, db_url = asyncio.run(fresh_schema(args.database_url))
    migrate.upgrade(db_url)
    queue = f"bench.{uuid.uuid4().hex[:8]}"
    proc = start_worker(args, queue, db_url, fair)
    try:
        asyncio.run(wait_ready(db_url, proc))
        return asyncio.run(two_clients(args, queue, proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        asyncio.run(drop_schema(args.database_url, schema))


def prefill_mix(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """In process: 8 requests decoding, then 8 long prompts arrive. TTFT of the new
    prompts (s) and inter-token latency of the decoding ones (ms), per mix."""
    out = {}
    for mix in ("decode-first", "chunked", "prefill-first"):
        engine = LLMEngine(
            EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048, prefill_mix=mix)  # type: ignore[arg-type]
        )
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"d{i}", [100 + i] * 16, params)
        for _ in range(4):
            engine.step()
        short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"p{i}", [200 + i] * args.long_prompt, short)
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
        ttft = sorted(final[f"p{i}"].timing.ttft_s for i in range(8))  # type: ignore[union-attr]
        gaps = sorted(g for i in range(8) for g in final[f"d{i}"].timing.gaps_s)  # type: ignore[union-attr]
        out[mix] = {
            "ttft_p50_s": percentile(ttft, 50),
            "itl_p50_ms": percentile(gaps, 50) * 1000,
            "itl_max_ms": gaps[-1] * 1000,
        }
        print(f"{mix}: {out[mix]}", file=sys.stderr)
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"CPU: {results['cpu']}", ""]
    lines += [
        f"Two clients through the queue (default model, max_num_seqs {args.max_num_seqs}): "
        f"A publishes {args.backlog} requests, then B {args.backlog // 10}; each "
        f"{args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens.",
        "",
        "| policy | client | TTFT p50 / p99 (s) | queue delay p50 / p99 (s) | output tok/s | all done (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for policy in ("fifo", "fair"):
        for c in ("a", "b"):
            r = results[policy][c]
            lines.append(
                f"| {policy} | {c} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                f"{r['queue_p50']:.2f} / {r['queue_p99']:.2f} | {r['tok_s']:.1f} | {r['done_s']:.1f} |"
            )
    lines += [
        "",
        "CPU per request (ms), FIFO against fair mode (its router moves each message once more):",
        "",
    ]
    lines += ["| party | fifo | fair |", "|---|---:|---:|"]
    parties = sorted(results["fifo"]["cpu_ms_per_req"])
    for p in parties:
        f, g = (
            results["fifo"]["cpu_ms_per_req"].get(p, 0.0),
            results["fair"]["cpu_ms_per_req"].get(p, 0.0),
        )
        lines.append(f"| {p} | {f:.2f} | {g:.2f} |")
    lines += [
        "",
        f"Prefill/decode mix, in process: 8 requests decoding, then 8 prompts of "
        f"{args.long_prompt} tokens arrive:",
        "",
        "| mix | TTFT p50 of the new prompts (s) | ITL p50 / max of the decoding ones (ms) |",
        "|---|---:|---:|",
    ]
    for mix, r in results["mix"].items():
        lines.append(
            f"| {mix} | {r['ttft_p50_s']:.2f} | {r['itl_p50_ms']:.0f} / {r['itl_max_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--backlog", type=int, default=100, help="client A's requests (B sends a tenth)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--b-after-s", type=float, default=2.0)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    ap.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"cpu": cpu_model()}
    results["fifo"] = through_worker(args, fair=False)
    results["fair"] = through_worker(args, fair=True)
    results["mix"] = prefill_mix(args)
    md = report(results, args)
    print("\n" + md)
    (args.out / "fairness.md").write_text(md)
    (args.out / "fairness.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "fairness.png")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(2)
    for i, c in enumerate(("a", "b")):
        a.bar(
            [v + i * 0.4 for v in x],
            [results[p][c]["ttft_p50"] for p in ("fifo", "fair")],
            width=0.4,
            label=f"client {c}" + (" (10x backlog)" if c == "a" else " (few requests)"),
        )
    a.set_xticks([v + 0.2 for v in x], ["FIFO", "fair share"])
    a.set_ylabel("TTFT p50 (s)")
    a.set_title("two clients, one queue")
    a.legend()
    mixes = list(results["mix"])
    b.bar(
        mixes, [results["mix"][m]["itl_max_ms"] for m in mixes], color="#a72", label="ITL max (ms)"
    )
    b2 = b.twinx()
    b2.plot(mixes, [results["mix"][m]["ttft_p50_s"] for m in mixes], "ko-", label="TTFT p50 (s)")
    b.set_ylabel("longest gap between tokens (ms)")
    b2.set_ylabel("TTFT p50 of new prompts (s)")
    b.set_title("prefill/decode mix")
    fig.suptitle(results["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
