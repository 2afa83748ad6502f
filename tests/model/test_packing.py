"""Linear weights packed once for oneDNN: the same results as torch's plain matmul
(bfloat16 bit for bit, float32 to summation order), chosen and undone as the config says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.builds import onednn_packs_bfloat16
from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.model.llama import Linear, padded_rows
from worker.model.loader import load_model
from worker.model.packing import pack_linear_layers

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


BF16_PACKS = onednn_packs_bfloat16()
# the narrow dtype the runner tests pack: float32 where oneDNN refuses bfloat16
PACKED_DTYPE = torch.bfloat16 if BF16_PACKS else torch.float32
PACKED_NAME = "bfloat16" if BF16_PACKS else "float32"


def _linear(dtype: torch.dtype, bias: bool, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    m = Linear(96, 160, bias=bias)
    m.weight = torch.nn.Parameter((torch.randn(160, 96, generator=g) / 10).to(dtype))
    if m.bias is not None:
        m.bias = torch.nn.Parameter(torch.randn(160, generator=g).to(dtype))
    return m.requires_grad_(False)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bfloat16_equals_the_plain_matmul(rows: int, bias: bool) -> None:
    """Bit for bit on the CPUs measured (AMD EPYC with avx512_bf16); one bfloat16 step is
    allowed, as another CPU's kernels (AMX) may block the sums of the two paths apart.
    Where oneDNN refuses bfloat16 (AVX2 only) the layer says so and stays plain."""
    m = _linear(torch.bfloat16, bias, rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 1))
    plain = m(x)
    weight = m.weight.clone()
    if not BF16_PACKS:
        with pytest.raises(RuntimeError):
            m.pack(64)
        assert not m.packed and torch.equal(m(x), plain)
        assert pack_linear_layers_of(m).startswith("torch (packing failed: ")
        return
    m.pack(64)
    assert m.packed and m.weight.shape == (160, 96) and m.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        packed = m(x)
    assert packed.shape == (rows, 160) and packed.dtype == torch.float32
    torch.testing.assert_close(packed, plain, rtol=2**-7, atol=1e-6)
    m.unpack()
    assert not m.packed and torch.equal(m.weight, weight)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 13, 64, 300])
def test_packed_float32_agrees_with_the_plain_matmul_and_pads_its_rows(rows: int) -> None:
    m = _linear(torch.float32, True, rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 2))
    want = F.linear(x, m.weight, m.bias)
    assert m.rows_for(rows) == rows  # plain float32 takes any row count
    m.pack(64)
    # oneDNN builds a kernel per row count: packed float32 rows come in buckets too
    assert m.rows_for(rows) == padded_rows(rows)
    seen: list[int] = []
    matmul = m.matmul
    m.matmul = lambda xp, *rest: seen.append(xp.shape[0]) or matmul(xp, *rest)  # type: ignore[method-assign]
    with torch.inference_mode():
        got = m(x)
        padded = m.matmul(m.narrow_input(x))
    assert seen[0] == padded_rows(rows)  # forward pads too
    assert got.shape == (rows, 160)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert padded.shape == (padded_rows(rows), 160)
    torch.testing.assert_close(padded[:rows], want, rtol=1e-5, atol=1e-5)


def test_same_dtype_rows_go_straight_to_the_matmul() -> None:
    """bfloat16 rows into plain bfloat16 weights (CUDA's case) are neither copied nor padded."""
    m = _linear(torch.bfloat16, False, 5)
    m.narrow_input = None  # type: ignore[assignment,method-assign]  # any call fails
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(m(x), F.linear(x, m.weight))


@needs_onednn
def test_the_runner_packs_the_decoder_and_the_narrow_head_only(default_model_dir) -> None:
    loaded = load_model(str(default_model_dir), dtype=PACKED_NAME)
    runner = ModelRunner(EngineConfig(num_kv_blocks=64, dtype=PACKED_NAME), loaded)
    model = runner.model
    decoder = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert decoder and all(m.packed for m in decoder)
    heads = 0
    if BF16_PACKS:  # float32 layers loaded so have no narrow head
        assert isinstance(model.narrow_head, Linear) and model.narrow_head.packed
        heads = 1
    packed, row_kernel = runner.info.linear.split("; ")
    assert packed == f"oneDNN, {len(decoder) + heads} weights packed at load"
    # decode steps and short prompt chunks: the C row kernel's own copy of the weights
    native = runner.native
    assert ("the C row kernel" in row_kernel) == (
        native is not None and native.matmul_rows_built
    ), row_kernel


@needs_onednn
def test_an_untied_full_projection_stays_plain(tiny_model_dir) -> None:
    """Its rows are read one by one to re-score the narrow copy's candidates."""
    path = str(tiny_model_dir("llama3"))  # untied lm_head
    loaded = load_model(path, dtype="bfloat16")
    loaded.model.narrow_output_projection(torch.bfloat16)
    runner = ModelRunner(EngineConfig(model=path, block_size=4, num_kv_blocks=64), loaded)
    assert runner.model.lm_head is not None and not runner.model.lm_head.packed
    assert isinstance(runner.model.narrow_head, Linear)
    assert runner.model.narrow_head.packed == BF16_PACKS


@needs_onednn
def test_a_torch_runner_unpacks_a_model_packed_before(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen2"))  # q/k/v biases
    loaded = load_model(path, dtype=PACKED_NAME)
    loaded.model.narrow_output_projection(PACKED_DTYPE)  # a packed narrow head (bfloat16)
    cfg = EngineConfig(model=path, block_size=4, num_kv_blocks=64, dtype=PACKED_NAME)
    packed = ModelRunner(cfg, loaded)
    assert packed.info.linear.startswith("oneDNN")
    ids = torch.randint(0, 1000, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    from tests.model.test_equivalence import _sched

    want = packed.all_logits([_sched("a", ids, 0, 19, list(range(5)))])["a"]
    plain = ModelRunner(
        EngineConfig(model=path, block_size=4, num_kv_blocks=64, linear="torch"), loaded
    )
    assert plain.info.linear.startswith("torch (set explicitly)")
    assert not any(m.packed for m in loaded.model.modules() if isinstance(m, Linear))
    assert (loaded.model.narrow_head is not None) == BF16_PACKS
    got = plain.all_logits([_sched("a", ids, 0, 19, list(range(5)))])["a"]
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bfloat16 rounding at most


@needs_onednn
def test_int8_layers_are_left_to_their_own_kernels(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir("llama3")), dtype="int8")
    assert pack_linear_layers(loaded.model, "auto", "cpu") == (
        "torch (no bfloat16 or float32 linear layers)"
    )
    with pytest.raises(ValueError, match="linear 'onednn' is not available"):
        pack_linear_layers(loaded.model, "onednn", "cpu")


@needs_onednn
def test_a_packing_that_fails_leaves_every_weight_plain(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(str(tiny_model_dir("llama3")), dtype=PACKED_NAME)
    linears = [m for m in loaded.model.layers.modules() if isinstance(m, Linear)]
    real_pack, calls = Linear.pack, []

    def pack_then_fail(self: Linear, rows: int) -> None:
        calls.append(self)
        if len(calls) == 3:  # halfway: two weights are packed already
            raise RuntimeError("no kernel for this dtype")
        real_pack(self, rows)

    monkeypatch.setattr(Linear, "pack", pack_then_fail)
    why = pack_linear_layers(loaded.model, "auto", "cpu")
    assert why == "torch (packing failed: no kernel for this dtype)"
    assert not any(m.packed for m in linears)
    calls.clear()
    with pytest.raises(ValueError, match="packing failed"):
        pack_linear_layers(loaded.model, "onednn", "cpu")
    assert len(calls) == 3 and not any(m.packed for m in linears)


def pack_linear_layers_of(m: Linear) -> str:
    """What pack_linear_layers says for a model holding only `m` (as its one layer)."""
    from types import SimpleNamespace

    model = SimpleNamespace(layers=torch.nn.ModuleList([m]), narrow_head=None)
    return pack_linear_layers(model, "auto", "cpu")  # type: ignore[arg-type]


def test_onednn_is_for_cpu() -> None:
    with pytest.raises(ValueError, match="linear 'onednn' packs weights for CPU"):
        EngineConfig(device="cuda", linear="onednn")
    with pytest.raises(ValueError, match="linear must be one of"):
        EngineConfig(linear="mkl")
