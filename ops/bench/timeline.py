"""Continuous batching, drawn from the engine's own step records.

Three batch slots; three running requests that need 18, 73 and 141 steps, and five
more waiting that need 30, 55, 12, 90 and 40. Run under static batching (a batch is
admitted only when the previous one has finished) and under continuous batching (a
waiting request joins at the first step boundary after a slot frees), with the default
model, and drawn as a timeline: which request occupies which slot at each step, and
when each waiting one starts.

    python ops/bench/timeline.py --out ops/bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.steplog import ENV
from worker.request import SamplingParams

RUNNING = (18, 73, 141)
WAITING = (30, 55, 12, 90, 40)
SLOTS = 3


def run(scheduling: str) -> list[dict[str, Any]]:
    """Every request (one prompt token, exactly its number of steps of output) submitted
    at once, in order; returns the engine's step log."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        os.environ[ENV] = str(log)
        try:
            engine = LLMEngine(
                EngineConfig(max_num_seqs=SLOTS, scheduling=scheduling)  # type: ignore[arg-type]
            )
        finally:
            del os.environ[ENV]
        for i, steps in enumerate((*RUNNING, *WAITING)):
            params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
            engine.add_request(f"r{i}:{steps}", [1], params)
        while engine.has_unfinished():
            engine.step()
        return [json.loads(line) for line in log.read_text().splitlines()]


def slot_timeline(steps: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """request -> (slot, first step, last step): a request takes the lowest free slot
    when it first runs and holds it until its last step."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in steps:
        for rid, *_ in s["scheduled"]:
            first.setdefault(rid, s["step"])
            last[rid] = s["step"]
    taken: dict[int, int] = {}  # slot -> last step of its request
    out: dict[str, tuple[int, int, int]] = {}
    for rid in sorted(first, key=lambda r: (first[r], r)):
        slot = next(i for i in range(SLOTS) if taken.get(i, -1) < first[rid])
        taken[slot] = last[rid]
        out[rid] = (slot, first[rid], last[rid])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: slot_timeline(run(name)) for name in ("static", "continuous")}
    rows = ["| request (steps) | static: starts at step | continuous: starts at step |"]
    rows.append("|---|---:|---:|")
    for rid in sorted(runs["static"], key=lambda r: int(r[1:].split(":")[0])):
        rows.append(
            f"| {rid.split(':')[1]} | {runs['static'][rid][1]} | {runs['continuous'][rid][1]} |"
        )
    ends = {name: max(t[2] for t in tl.values()) for name, tl in runs.items()}
    rows.append(f"| **all done** | **{ends['static']}** | **{ends['continuous']}** |")
    md = "\n".join(rows) + "\n"
    print(md)
    (args.out / "timeline.md").write_text(md)
    plot(runs, args.out / "timeline.png")


def plot(runs: dict[str, dict[str, tuple[int, int, int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
    colors = plt.get_cmap("tab10")
    for ax, (name, tl) in zip(axes, runs.items(), strict=True):
        for rid, (slot, start, end) in tl.items():
            i, steps = rid[1:].split(":")
            waiting = int(i) >= len(RUNNING)
            ax.barh(slot, end - start + 1, left=start, color=colors(int(i)), edgecolor="k")
            ax.text(start + (end - start) / 2, slot, steps, ha="center", va="center", fontsize=8)
            if waiting:
                ax.plot(start, slot + 0.42, "v", color="k", markersize=5)
        ax.set_yticks(range(SLOTS), [f"slot {s}" for s in range(SLOTS)])
        ax.set_title(
            f"{name} batching: all {len(tl)} requests done at step {max(e for _, _, e in tl.values())}"
            " (▼: a waiting request starts)",
            fontsize=9,
        )
        ax.invert_yaxis()
    axes[-1].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
