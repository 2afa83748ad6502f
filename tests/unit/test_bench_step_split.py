"""The engine benchmark's split of a run's steps by kind (ops/bench/engine.py): each step
counted once, in the kind its prompt tokens and sequences put it, the shares of its time."""

from __future__ import annotations

import pytest

from tests.bench_modules import load_bench
from worker.engine.outputs import StepStats

engine_bench = load_bench("engine")


def step(batch: int, prompt: int, decode: int, seconds: float) -> StepStats:
    return StepStats(
        step=0,
        started_at=0.0,
        batch_size=batch,
        num_prefill_tokens=prompt,
        num_decode_tokens=decode,
        num_sampled=batch,
        num_waiting=0,
        num_preempted=0,
        kv_usage=0.0,
        step_time_s=seconds,
        forward_time_s=seconds,
        sample_time_s=0.0,
    )


def test_steps_are_split_by_prompt_tokens_then_sequences() -> None:
    stats = [
        step(8, 2048, 0, 2.0),  # a prompt step, whatever its batch
        step(40, 100, 39, 1.0),  # prompt tokens beside decode ones: still a prompt step
        step(1, 0, 1, 0.25),
        step(8, 0, 8, 0.25),
        step(9, 0, 9, 0.5),
        step(32, 0, 32, 0.5),
        step(33, 0, 33, 0.25),
        step(64, 0, 64, 0.25),
    ]
    rows = {r["kind"]: r for r in engine_bench.step_split(stats)}
    assert [r["steps"] for r in rows.values()] == [2, 2, 2, 2]
    assert rows["with prompt tokens"]["seconds"] == 3.0
    assert rows["with prompt tokens"]["prompt_tokens"] == 2148
    assert rows["with prompt tokens"]["decode_tokens"] == 39
    assert rows["decode, 9-32 sequences"]["decode_tokens"] == 41
    assert [r["share"] for r in rows.values()] == pytest.approx([0.6, 0.1, 0.2, 0.1])
    table = engine_bench.split_table(list(rows.values()))
    assert "| with prompt tokens | 2 | 3.00 | 60% | 2148 | 39 |" in table


def test_a_run_without_steps_splits_into_empty_kinds() -> None:
    rows = engine_bench.step_split([])
    assert [(r["steps"], r["seconds"]) for r in rows] == [(0, 0.0)] * 4
