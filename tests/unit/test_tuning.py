"""Choosing the batch size from a measured curve (no model: a fake step and clock)."""

from __future__ import annotations

import pytest

from worker.engine.outputs import SchedulerOutput
from worker.engine.tuning import choose_batch, measure_curve, probe_sizes


def test_probe_sizes_climb_to_the_cap() -> None:
    assert probe_sizes(64) == [4, 8, 16, 32, 64]
    assert probe_sizes(48) == [4, 8, 16, 32, 48]
    assert probe_sizes(3) == [3]


def test_the_smallest_batch_within_tolerance_of_the_best_wins() -> None:
    rising = [(8, 100.0), (16, 180.0), (32, 300.0), (64, 400.0)]
    assert choose_batch(rising) == 64
    plateau = [(8, 100.0), (16, 180.0), (32, 390.0), (64, 400.0), (128, 380.0)]
    assert choose_batch(plateau) == 32  # 390 >= 0.95 * 400
    falling = [(8, 100.0), (16, 300.0), (32, 200.0)]
    assert choose_batch(falling) == 16
    assert choose_batch(plateau, tolerance=1.0) == 64
    with pytest.raises(ValueError, match="no batch sizes"):
        choose_batch([])


class FakeStep:
    """A step whose cost is `fixed + per_seq * batch` seconds on a clock it advances."""

    def __init__(self, fixed: float, per_seq: float) -> None:
        self.now = 0.0
        self.fixed, self.per_seq = fixed, per_seq
        self.seen: list[SchedulerOutput] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, sched: SchedulerOutput) -> None:
        self.seen.append(sched)
        self.now += self.fixed + self.per_seq * len(sched.scheduled)


def test_the_curve_is_decode_steps_over_disjoint_blocks() -> None:
    step = FakeStep(fixed=0.02, per_seq=0.001)
    curve, context = measure_curve(
        step, [4, 16, 64], num_blocks=2000, block_size=16, context=256, steps=3, clock=step.clock
    )
    assert context == 256
    for (batch, rate), want in zip(curve, (4, 16, 64), strict=True):
        assert batch == want
        assert rate == pytest.approx(batch / (0.02 + 0.001 * batch))
    assert len(step.seen) == 3 * 4  # one untimed and three timed steps per size
    last = step.seen[-1]
    assert last.num_decode_tokens == 64 and last.num_prefill_tokens == 0
    blocks = [b for r in last.scheduled for b in r.block_ids]
    assert len(blocks) == len(set(blocks)) == 64 * 17  # 257 tokens: 17 blocks of 16
    assert max(blocks) < 2000
    for r in last.scheduled:
        assert r.is_decode and r.samples and r.start == 256


def test_a_small_cache_shortens_the_probed_context() -> None:
    step = FakeStep(fixed=0.01, per_seq=0.0)
    curve, context = measure_curve(
        step, [8, 32], num_blocks=100, block_size=16, context=256, steps=1, clock=step.clock
    )
    assert [b for b, _ in curve] == [8, 32]
    assert context == 3 * 16 - 1  # 100 // 32 = 3 blocks a sequence, the new token included
    blocks = [b for r in step.seen[-1].scheduled for b in r.block_ids]
    assert len(blocks) == len(set(blocks)) and max(blocks) < 100
