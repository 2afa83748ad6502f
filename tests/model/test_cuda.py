"""The CUDA path: same tokens as on CPU, in float32, float16 and bfloat16.

These tests need a CUDA device; without one they are skipped (the only reason a test
here may skip).
"""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.model.loader import load_model
from worker.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 40, 64)]


def _run(path: str, device: str, dtype: str, **kw) -> list[list[int]]:
    loaded = load_model(path, dtype=dtype, device=device)
    cfg = EngineConfig(
        model=path, device=device, dtype=dtype, block_size=16, num_kv_blocks=128, **kw
    )
    engine = LLMEngine(cfg, loaded=loaded)
    outs = engine.generate(
        _prompts(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    return [o.token_ids for o in outs]


def test_cuda_float32_matches_cpu(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama3"))
    assert _run(path, "cuda", "float32") == _run(path, "cpu", "float32")


def test_cuda_chunked_prefill_matches(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen3"))
    plain = _run(path, "cuda", "float32")
    assert _run(path, "cuda", "float32", max_num_batched_tokens=16) == plain


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_half_precision_runs_and_mostly_agrees(tiny_model_dir, dtype: str) -> None:
    path = str(tiny_model_dir("smollm2"))
    half = _run(path, "cuda", dtype)
    full = _run(path, "cpu", "float32")
    # Low precision may flip a near-tie; most first tokens must agree.
    agree = sum(h[0] == f[0] for h, f in zip(half, full, strict=True))
    assert agree >= len(full) - 1
    assert all(len(h) == 24 for h in half)


def _engine(path: str, **kw) -> LLMEngine:
    loaded = load_model(path, dtype="float32", device="cuda")
    cfg = EngineConfig(
        model=path, device="cuda", dtype="float32", block_size=16, num_kv_blocks=128, **kw
    )
    return LLMEngine(cfg, loaded=loaded)


def _tokens(engine: LLMEngine) -> list[list[int]]:
    # outputs of differing lengths: the batch shrinks through several graph buckets
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (24, 9, 17, 3)
    ]
    return [o.token_ids for o in engine.generate(_prompts(), params)]


@pytest.mark.parametrize("variant", ["smollm2", "mistral", "qwen3"])
def test_cuda_decode_graphs_replay_the_eager_steps(tiny_model_dir, variant: str) -> None:
    path = str(tiny_model_dir(variant))
    engine = _engine(path)  # decode_graphs "auto": captured on CUDA
    got = _tokens(engine)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    assert graphs.stats.failed is None, graphs.stats.failed
    assert graphs.stats.captured >= 2 and graphs.stats.replays > graphs.stats.captured
    assert got == _tokens(_engine(path, decode_graphs="off"))
    assert got == _tokens(_engine(path, decode_graphs="eager"))


def test_cuda_decode_graphs_fall_back_when_capture_fails(tiny_model_dir, monkeypatch) -> None:
    path = str(tiny_model_dir("smollm2"))
    want = _tokens(_engine(path, decode_graphs="off"))

    def refuse(self, *a, **kw):
        raise RuntimeError("capture refused by the test")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    engine = _engine(path)
    assert _tokens(engine) == want
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.stats.replays == 0 and graphs.stats.captured == 0
    assert graphs.stats.failed is not None and "capture refused" in graphs.stats.failed
    assert graphs.stats.eager_steps > 0


def test_cuda_decode_graph_replays_after_later_captures_in_bfloat16(tiny_model_dir) -> None:
    """A bucket's graph replayed again after other buckets were captured into the same
    pool (A, B, A), each replay's logits against the same step op by op."""
    path = str(tiny_model_dir("llama3"))
    loaded = load_model(path, dtype="bfloat16", device="cuda")
    cfg = EngineConfig(
        model=path, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=128
    )
    engine = LLMEngine(cfg, loaded=loaded)
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    checked = []
    run = graphs.run

    def checking(members, key):
        out = run(members, key)
        assert out is not None
        got = out.clone()
        eager, rows = runner._eager_step(members)  # writes the same K/V again
        at = {s.request_id: i for i, s in enumerate(rows)}
        order = torch.tensor([at[s.request_id] for s in members], device=got.device)
        torch.testing.assert_close(got, eager[order], rtol=2e-2, atol=2e-2)
        checked.append(key)
        return out

    graphs.run = checking
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for batch in (4, 1, 4, 2, 4):  # buckets 4, 1, 4 again, 2, 4 again
        engine.generate(_prompts()[:batch], greedy)
    assert {k.batch for k in graphs.stats.keys} == {1, 2, 4}
    later = checked[checked.index(next(k for k in checked if k.batch == 1)) :]
    assert any(k.batch == 4 for k in later)  # a batch-4 graph replayed after others' capture
    assert graphs.stats.failed is None, graphs.stats.failed
