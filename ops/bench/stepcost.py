"""The engine's own cost per one-token request: its step loop fed bursts of requests.

The queue path's ceiling includes the engine process; this isolates it. The engine's
step driver (the loop the worker's engine process runs) is fed one-token prompts with
max_tokens 1 in bursts of B requests per step boundary, its reports pickled as the
process pipe would, and the CPU per request split by the steps' own records: the model's
forward pass, sampling, and the rest (scheduling, inputs, outputs, detokenization: the
per-request bookkeeping). Small bursts show the fixed cost of a step; large ones the
cost a request adds to a prefill-only step of hundreds of short prompts.

    python ops/bench/stepcost.py --model DIR   # or: pipeline.py --stages engine

Run it as the worker runs its engine process: with GOMP_SPINCOUNT=1000 set before
torch loads (pipeline.py does), so that idle OpenMP threads do not spin.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.step_driver import Add, Command, StepDriver, StepReport, Stop
from worker.request import SamplingParams

BURSTS = (4, 64, 256)


def step_cost(model: str | None, n: int, bursts: tuple[int, ...] = BURSTS) -> list[dict[str, Any]]:
    """One run per burst size: requests/s, CPU ms per request and its split."""
    config = EngineConfig(model=model, max_num_seqs=max(bursts), max_num_batched_tokens=4096)
    loaded = LLMEngine(config).loaded
    # A fresh engine (scheduler, cache) per burst size, on the same weights.
    return [_run(LLMEngine(config, loaded), n, burst) for burst in bursts]


def _run(engine: LLMEngine, n: int, burst: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    adds: list[Command] = [Add(f"{burst}-{i}", [1], params, None, 0, None) for i in range(n)]
    fed = finished = 0
    forward = sample = 0.0
    bar = tqdm(total=n, desc=f"engine, bursts of {burst}", unit="req")

    def next_commands(block: bool) -> list[Command]:
        nonlocal fed
        if fed >= n:
            return [Stop()] if finished >= n else []
        fed += burst
        return adds[fed - burst : fed]

    def report(r: StepReport) -> None:
        nonlocal finished, forward, sample
        pickle.dumps(r)  # what the process pipe costs
        done = sum(1 for o in r.outputs if o.finished)
        finished += done
        bar.update(done)
        if r.stats is not None:
            forward += r.stats.forward_time_s
            sample += r.stats.sample_time_s

    wall0, cpu0 = time.perf_counter(), time.process_time()
    StepDriver(engine, next_commands, report).run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    bar.close()
    return {
        "burst": burst,
        "req_s": n / wall,
        "cpu_ms_per_req": 1000 * cpu / n,
        "forward_ms_per_req": 1000 * forward / n,
        "sample_ms_per_req": 1000 * sample / n,
        "rest_ms_per_req": 1000 * max(0.0, wall - forward - sample) / n,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| requests per step | requests/s | CPU ms/request | forward ms | sampling ms | rest ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['burst']} | {r['req_s']:.0f} | {r['cpu_ms_per_req']:.3f} | "
            f"{r['forward_ms_per_req']:.3f} | {r['sample_ms_per_req']:.3f} | "
            f"{r['rest_ms_per_req']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the bundled one)")
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    rows = step_cost(args.model, args.n)
    if args.json:
        args.json.write_text(json.dumps(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
