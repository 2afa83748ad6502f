"""Linear weights packed once for oneDNN: the same results as torch's plain matmul
(bfloat16 bit for bit, float32 to summation order), chosen and undone as the config says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.model.llama import Linear, padded_rows
from worker.model.loader import load_model
from worker.model.packing import pack_linear_layers

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


def _linear(dtype: torch.dtype, bias: bool, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    m = Linear(96, 160, bias=bias)
    m.weight = torch.nn.Parameter((torch.randn(160, 96, generator=g) / 10).to(dtype))
    if m.bias is not None:
        m.bias = torch.nn.Parameter(torch.randn(160, generator=g).to(dtype))
    return m.requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bfloat16_equals_the_plain_matmul_bit_for_bit(rows: int, bias: bool) -> None:
    m = _linear(torch.bfloat16, bias, rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 1))
    plain = m(x)
    weight = m.weight.clone()
    m.pack(64)
    assert m.packed and m.weight.shape == (160, 96) and m.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        packed = m(x)
    assert packed.shape == (rows, 160) and packed.dtype == torch.float32
    assert torch.equal(packed, plain)
    m.unpack()
    assert not m.packed and torch.equal(m.weight, weight)


@pytest.mark.parametrize("rows", [1, 13, 64, 300])
def test_packed_float32_agrees_with_the_plain_matmul_and_pads_its_rows(rows: int) -> None:
    m = _linear(torch.float32, True, rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 2))
    want = F.linear(x, m.weight, m.bias)
    assert m.rows_for(rows) == rows  # plain float32 takes any row count
    m.pack(64)
    # oneDNN builds a kernel per row count: packed float32 rows come in buckets too
    assert m.rows_for(rows) == padded_rows(rows)
    with torch.inference_mode():
        got = m(x)
        padded = m.matmul(m.narrow_input(x))
    assert got.shape == (rows, 160)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert padded.shape == (padded_rows(rows), 160)
    torch.testing.assert_close(padded[:rows], want, rtol=1e-5, atol=1e-5)


def test_the_runner_packs_the_decoder_and_the_narrow_head_only(default_model_dir) -> None:
    loaded = load_model(str(default_model_dir), dtype="bfloat16")
    runner = ModelRunner(EngineConfig(num_kv_blocks=64), loaded)
    model = runner.model
    decoder = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert decoder and all(m.packed for m in decoder)
    assert isinstance(model.narrow_head, Linear) and model.narrow_head.packed
    # the full-precision projection's rows are read one by one to re-score candidates
    assert not model.embed_tokens.weight.is_mkldnn
    assert runner.info.linear == f"oneDNN, {len(decoder) + 1} weights packed at load"


def test_a_torch_runner_unpacks_a_model_packed_before(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen2"))  # q/k/v biases
    loaded = load_model(path, dtype="bfloat16")
    cfg = EngineConfig(model=path, block_size=4, num_kv_blocks=64, dtype="bfloat16")
    packed = ModelRunner(cfg, loaded)
    assert packed.info.linear.startswith("oneDNN")
    ids = torch.randint(0, 1000, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    from tests.model.test_equivalence import _sched

    want = packed.all_logits([_sched("a", ids, 0, 19, list(range(5)))])["a"]
    plain = ModelRunner(
        EngineConfig(model=path, block_size=4, num_kv_blocks=64, linear="torch"), loaded
    )
    assert plain.info.linear == "torch (set explicitly)"
    assert not any(m.packed for m in loaded.model.modules() if isinstance(m, Linear))
    got = plain.all_logits([_sched("a", ids, 0, 19, list(range(5)))])["a"]
    assert torch.equal(got, want)  # bfloat16: packing changes no bit


def test_int8_layers_are_left_to_their_own_kernels(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir("llama3")), dtype="int8")
    assert pack_linear_layers(loaded.model, "auto", "cpu") == (
        "torch (no bfloat16 or float32 linear layers)"
    )
    with pytest.raises(ValueError, match="linear 'onednn' is not available"):
        pack_linear_layers(loaded.model, "onednn", "cpu")


def test_onednn_is_for_cpu() -> None:
    with pytest.raises(ValueError, match="linear 'onednn' packs weights for CPU"):
        EngineConfig(device="cuda", linear="onednn")
    with pytest.raises(ValueError, match="linear must be one of"):
        EngineConfig(linear="mkl")
