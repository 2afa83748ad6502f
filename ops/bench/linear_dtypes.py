"""Linear layers and decode steps in float32, bfloat16 and int8, side by side.

    nice -n 5 python ops/bench/linear_dtypes.py          # batch 16, 32, 64; 1 thread

One process, one thread, CPU time (`time.thread_time`, so another process's load
does not count), medians. Per batch size: ms per call of each decoder linear layer
(layer 0's; every layer has the same shapes) and of the logits (`compute_logits`: the
output projection, plus the float32 re-scoring behind a narrow one), then the decoder's
linear layers and the logits together. Then the median of decode-only engine steps at
batch 64, contexts of 256 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import _fill

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.model.loader import LoadedModel

DTYPES = ("float32", "bfloat16", "int8")
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median thread CPU ms of `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1000)
    return statistics.median(times)


def linear_ms(loaded: LoadedModel, batch: int, repeats: int) -> dict[str, float]:
    """ms per call of layer 0's linear layers and of compute_logits at `batch` rows."""
    model = loaded.model
    layer = model.layers[0]
    mods = {
        "qkv_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
    }
    g = torch.Generator().manual_seed(batch)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, m in mods.items():
            x = torch.randn(batch, _in_features(m), generator=g)  # float32, as in the model
            out[name] = cpu_ms(lambda m=m, x=x: m(x), repeats)
        h = torch.randn(batch, loaded.config.hidden_size, generator=g)
        out["logits"] = cpu_ms(lambda: model.compute_logits(h), repeats)
    out["all"] = sum(out[k] for k in KINDS) * loaded.config.num_layers + out["logits"]
    return out


def _in_features(m: torch.nn.Module) -> int:
    weight = getattr(m, "weight", None)
    return int(weight.shape[1]) if weight is not None else int(m.in_features)


def step_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median thread CPU ms of decode-only steps at `batch` sequences."""
    _fill(engine, batch, 256, steps)
    times = []
    for _ in range(steps):
        t0 = time.thread_time()
        engine.step()
        times.append((time.thread_time() - t0) * 1000)
    engine.abort(list(engine.scheduler.requests))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engines = {
        d: LLMEngine(EngineConfig(dtype=d, num_threads=1, max_num_seqs=64, num_kv_blocks=1200))
        for d in DTYPES
    }
    for d, e in engines.items():
        print(f"{d}: linear layers {e.info.linear}", file=sys.stderr)
    print("| batch | layer | " + " | ".join(f"{d} ms" for d in DTYPES) + " | int8 / float32 |")
    print("|---:|---|" + "---:|" * (len(DTYPES) + 1))
    for b in (int(x) for x in args.batches.split(",")):
        res = {d: linear_ms(e.loaded, b, args.repeats) for d, e in engines.items()}
        for k in (*KINDS, "logits", "all"):
            cells = " | ".join(f"{res[d][k]:.2f}" for d in DTYPES)
            print(f"| {b} | {k} | {cells} | {res['int8'][k] / res['float32'][k]:.2f} |")
    steps = {d: step_ms(e, 64, args.steps) for d, e in engines.items()}
    cells = " | ".join(f"{steps[d]:.1f}" for d in DTYPES)
    print(f"| 64 | decode step | {cells} | {steps['int8'] / steps['float32']:.2f} |")


if __name__ == "__main__":
    main()
