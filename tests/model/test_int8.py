"""Int8 linear layers (worker.model.quant): error bounded by the quantization steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.hardware import int8_reduce_range, read_cpu_flags
from worker.model.llama import NARROW_HEAD_MIN_HIDDEN, RESCORED
from worker.model.loader import dtype_name, load_model
from worker.model.quant import Int8Linear
from worker.request import SamplingParams

# The CPU's own input width (7 bits without integer dot products, where 8 could saturate
# the 16-bit pair sums) and, where that is 8 bits, 7 as well: both must hold the bound.
CPU_REDUCE_RANGE = int8_reduce_range(read_cpu_flags())
RANGES = sorted({True, CPU_REDUCE_RANGE})


def error_bound(x: torch.Tensor, w: torch.Tensor, lin: Int8Linear) -> torch.Tensor:
    """[T, out] worst case of |int8 result - exact| under round-to-nearest: weights off by
    at most half their row's step s, inputs by half of 2 |x|max / levels (255 levels in 8
    bits, 127 in 7, over the pinned [-1, 1] range, scaled back by the row's |x| max)."""
    levels = 127 if lin.reduce_range else 255
    dx = x.abs().amax(-1, keepdim=True) * 2 / levels  # [T, 1] the input's step
    wq = w.abs() + lin.scale[:, None] / 2  # [out, in] |dequantized weight| at most
    by_weights = x.abs().sum(-1, keepdim=True) * lin.scale[None, :] / 2  # [T, out]
    by_inputs = dx / 2 * wq.sum(1)[None, :]  # [T, out]
    return by_weights + by_inputs + 1e-4  # float32 rounding of the scaled result


@pytest.mark.parametrize("reduce_range", RANGES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_int8_linear_stays_within_the_quantization_bound(rows: int, reduce_range: bool) -> None:
    g = torch.Generator().manual_seed(31 + rows)
    w = torch.randn(200, 96, generator=g) * 0.1
    b = torch.randn(200, generator=g)
    lin = Int8Linear(w, b, reduce_range)
    x = torch.randn(rows, 96, generator=g)
    x[0] *= 1000  # an outlier row must not coarsen the others
    got = lin(x)
    want = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    err = (got.double() - want).abs()
    bound = error_bound(x, w, lin).double()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max():.3g}"
    # Rounding errors cancel: on average far inside the worst case.
    assert float(err.mean()) < 0.2 * float(bound.mean())


def test_int8_linear_rows_are_bitwise_the_same_in_any_batch() -> None:
    g = torch.Generator().manual_seed(32)
    lin = Int8Linear(torch.randn(64, 48, generator=g), None, CPU_REDUCE_RANGE)
    x = torch.randn(20, 48, generator=g)
    x[3] *= 500
    x[4] = 0  # a zero row gives zeros, not NaN
    together = lin(x)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)
    assert torch.equal(together[4], torch.zeros(64))


def test_int8_weights_use_per_row_steps_and_zero_rows_survive() -> None:
    g = torch.Generator().manual_seed(33)
    w = torch.randn(16, 32, generator=g)
    w[5] = 0
    lin = Int8Linear(w, None, reduce_range=True)
    torch.testing.assert_close(lin.scale[:5], w[:5].abs().amax(1) / 127)
    deq = lin.dequantized_weight()
    assert deq.shape == w.shape
    assert bool(((deq - w).abs() <= lin.scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(deq[5], torch.zeros(32))
    assert torch.isfinite(lin(torch.randn(3, 32, generator=g))).all()


@pytest.mark.parametrize("variant", ["smollm2", "llama3"])  # tied and untied output weights
def test_an_int8_model_keeps_float32_everywhere_but_its_linear_layers(
    tiny_model_dir: Callable[[str], Path], variant: str
) -> None:
    loaded = load_model(str(tiny_model_dir(variant)), dtype="int8")
    model = loaded.model
    assert dtype_name(loaded) == "int8"
    layer = model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(lin, Int8Linear)
    # Too small a hidden size for the loader to narrow the projection: narrowed here.
    assert model.config.hidden_size < NARROW_HEAD_MIN_HIDDEN and model.narrow_head is None
    model.narrow_output_projection(torch.qint8, int8_reduce_range(read_cpu_flags()))
    assert isinstance(model.narrow_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert model.norm.weight.dtype == torch.float32
    # The narrow int8 head: its best RESCORED per row scored again exactly in float32.
    weight = model.output_weight
    assert weight.dtype == torch.float32
    hidden = torch.randn(37, weight.shape[1], generator=torch.Generator().manual_seed(34))
    with torch.inference_mode():
        got = model.compute_logits(hidden)
        h = model.norm(hidden)
        exact = h @ weight.T  # [S, V]
        narrow = model.narrow_head(h)
    top = narrow.topk(RESCORED, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test_the_engine_runs_int8_end_to_end(tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir("smollm2")
    cfg = EngineConfig(model=str(path), dtype="int8", block_size=4, num_kv_blocks=128)
    engine = LLMEngine(cfg)
    assert engine.info.dtype == "int8" and engine.info.dtype_reason == "set explicitly"
    assert engine.info.kv_cache_dtype.startswith("float32")
    assert engine.runner.kv_dtype == torch.float32
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(prompts, params)]
    assert [len(t) for t in together] == [12, 12]
    # Per-row quantization: batching never changes what a request gets.
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_int8_is_for_cpus_only(tiny_model_dir: Callable[[str], Path]) -> None:
    EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="not supported on cuda"):
        EngineConfig(dtype="int8", device="cuda")
    with pytest.raises(ValueError, match="CPU only"):
        load_model(str(tiny_model_dir("smollm2")), dtype="int8", device="cuda")
