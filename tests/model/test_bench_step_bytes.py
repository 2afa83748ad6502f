"""The step profile's memory limit (ops/bench/step_profile.py): the bytes a decode step
must read, counted from the model's shapes and the cache's rows, not from the code that
computes them."""

from __future__ import annotations

import pytest

from tests.bench_modules import load_bench
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine

step_profile = load_bench("step_profile")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "row_bytes"),
    # a head's K and V rows of a token: D values each, int8 rows with their float32 scale
    [("float32", lambda d: 8 * d), ("bfloat16", lambda d: 4 * d), ("int8", lambda d: 2 * d + 8)],
)
def test_a_step_reads_its_weights_once_and_every_cached_row(
    tiny_model_dir, kv_cache_dtype: str, row_bytes
) -> None:
    path = tiny_model_dir("smollm2")
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        linear="torch",
        attention="torch",
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=64,
        tune_batch=False,
    )
    engine = LLMEngine(cfg)
    mc = engine.runner.model.config
    C, D, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
    q, kv = mc.num_heads * D, mc.num_kv_heads * D
    # float32 plain weights: qkv, o, gate and up, down per layer; the tied output projection
    per_layer = C * (q + 2 * kv) + q * C + C * 2 * inter + inter * C
    weights = 4 * (mc.num_layers * per_layer + mc.vocab_size * C)
    per_token = mc.num_layers * mc.num_kv_heads * row_bytes(D)
    assert step_profile.step_bytes(engine, 8, 0) == weights
    assert step_profile.step_bytes(engine, 8, 100) == weights + 8 * 100 * per_token
    assert step_profile.step_bytes(engine, 4, 37.5) == weights + 4 * 37.5 * per_token
    # the table's memory columns: the bytes at the read rate, against the step's time
    prof = step_profile.StepProfile(8, 50.0, dict.fromkeys(step_profile.PHASES, 1.0), 100, 90)
    assert prof.memory_ms == 0.0 and "memory limit" not in step_profile.table([prof], "float32")
    prof.bytes_read, prof.read_gb_s = 2e9, 100.0
    assert prof.memory_ms == pytest.approx(20.0)
    assert "| 2000 | 20.0 | 40% |" in step_profile.table([prof], "float32")
    # the parts' own steps: what they sum to, beside the median of the steps timed whole
    assert "timed part by part" not in step_profile.table([prof], "float32")
    other = step_profile.StepProfile(64, 95.0, dict.fromkeys(step_profile.PHASES, 2.0), 900, 800)
    prof.split_ms, other.split_ms = 5.0, 110.3
    note = step_profile.table([prof, other], "float32").splitlines()[-1]
    assert "their mean 5.0 / 110.3 ms at batch 8 / 64" in note, note


def test_the_decode_fill_outlasts_a_long_prefill_and_refuses_what_cannot_fit(
    tiny_model_dir,
) -> None:
    """The step profile's fill: 8 prompts of 64 tokens at 32 prompt tokens a step take 16
    steps to prefill, longer than the profile's own steps; the first sequences are still
    running when the last is prefilled, so the batch is whole, decoding. A batch the cache
    cannot hold at once is refused with the blocks it needs."""
    cfg = EngineConfig(
        model=str(tiny_model_dir("smollm2")),
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_kv_blocks=64,
        tune_batch=False,
    )
    engine = LLMEngine(cfg)
    step_profile._fill(engine, 8, 64, 2)
    stats = engine.last_stats
    assert stats is not None and stats.batch_size == 8 and stats.num_prefill_tokens == 0
    engine.abort(list(engine.scheduler.requests))
    with pytest.raises(ValueError, match=r"need \d+ KV blocks; the cache holds 64"):
        step_profile._fill(engine, 8, 256, 2)
