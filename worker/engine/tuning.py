"""The batch size this machine serves best: measured, not assumed.

A decode step's cost grows with the batch, and past some size a step costs more than the
extra sequences give: on a CPU the attention over every sequence's context and the
spilling of caches catch up with the matmuls, whose cost per token stops falling. Where
that happens depends on the machine (cores, bfloat16 support, memory bandwidth) and the
model, so `--tune-batch` measures it at start-up: decode-only steps at growing batch
sizes over contexts of `context` tokens, straight through the model runner (the
scheduler and the cache's bookkeeping are not involved; the steps write K/V into blocks
no request owns yet). The scheduler then runs at most the chosen number of sequences;
`max_num_seqs` stays the upper bound.

Choice (`choose_batch`): the smallest batch size whose decode tokens/s is within
`tolerance` of the best measured. Bigger batches than that add latency to every sequence
(each step takes longer) for less than `tolerance` more throughput.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.request import SamplingParams

if TYPE_CHECKING:
    from worker.engine.model_runner import ModelRunner

# Within this share of the best decode rate, the smaller batch wins (lower latency).
TOLERANCE = 0.95
PROBE_CONTEXT = 256  # tokens of context per probed sequence
PROBE_STEPS = 3  # timed steps per batch size (the median is kept), after one untimed


@dataclass(frozen=True)
class OperatingPoint:
    """The batch size chosen and the curve it was chosen from."""

    max_running: int
    curve: tuple[tuple[int, float], ...]  # (batch size, decode tokens/s), batch ascending
    context: int  # tokens of context per sequence while measuring

    def describe(self) -> str:
        points = ", ".join(f"{b}: {r:.0f}" for b, r in self.curve)
        return (
            f"at most {self.max_running} sequences (decode tok/s by batch at "
            f"{self.context} tokens of context: {points})"
        )


def probe_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to measure: powers of two from 4 below max_num_seqs, and max_num_seqs."""
    sizes = [b for b in (4, 8, 16, 32, 64, 128, 256, 512) if b < max_num_seqs]
    return [*sizes, max_num_seqs]


def choose_batch(curve: list[tuple[int, float]], tolerance: float = TOLERANCE) -> int:
    """The smallest batch size whose rate is within `tolerance` of the best rate."""
    if not curve:
        raise ValueError("no batch sizes were measured")
    best = max(rate for _, rate in curve)
    return min(b for b, rate in curve if rate >= tolerance * best)


def measure_curve(
    execute: Callable[[SchedulerOutput], object],
    sizes: list[int],
    num_blocks: int,
    block_size: int,
    context: int = PROBE_CONTEXT,
    steps: int = PROBE_STEPS,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[tuple[int, float]], int]:
    """Decode tokens/s at each batch size (median of `steps` timed steps) and the context
    used: `context` tokens per sequence, less where the cache cannot hold the largest
    batch at that length. Sequences use disjoint blocks, as real ones do."""
    per_seq = max(1, num_blocks // max(sizes))
    context = max(1, min(context, per_seq * block_size - 1))
    nb = -(-(context + 1) // block_size)  # blocks per sequence, the new token's included
    tokens = [1] * (context + 1)  # the contents do not change a step's cost
    # greedy rows: their steps pick from the output projection's candidates where the
    # model can (greedy_tokens), ~2-3% under a sampled step's time at 16-64 rows
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    curve = []
    for batch in sizes:
        rows = [
            ScheduledRequest(
                request_id=f"probe-{i}",
                token_ids=tokens,
                start=context,
                num_new_tokens=1,
                block_ids=range(i * nb, (i + 1) * nb),
                num_prompt_tokens=1,
                sampling_params=greedy,
                eos_token_ids=(),
            )
            for i in range(batch)
        ]
        sched = SchedulerOutput(
            step=0, scheduled=rows, num_prefill_tokens=0, num_decode_tokens=batch
        )
        execute(sched)  # untimed: first-use costs (kernel selection, buffers)
        times = []
        for _ in range(steps):
            t0 = clock()
            execute(sched)
            times.append(clock() - t0)
        curve.append((batch, batch / max(statistics.median(times), 1e-9)))
    return curve, context


def tune(runner: ModelRunner, max_num_seqs: int) -> OperatingPoint:
    """Measure `runner` at the probe sizes up to max_num_seqs and choose the batch cap.
    Runs before any request: the probed blocks are free, and later writes overwrite them."""
    curve, context = measure_curve(
        runner.execute_model, probe_sizes(max_num_seqs), runner.info.num_blocks, runner.block_size
    )
    return OperatingPoint(choose_batch(curve), tuple(curve), context)
