"""Float32 linear layers as 16-bit integer products (kernels/int16_matmul.c, or
int16_matmul_vnni.c where the CPU has AVX-512 VNNI): the layout, the kernel against the
products of the rounded operands it claims to compute, its error against float64 next to
bfloat16's, no overflow at the extremes, refusals, and which path a Linear takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.builds import kernel_builds, load_build
from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import ScheduledRequest
from worker.hardware import read_cpu_flags
from worker.model.llama import Linear
from worker.model.loader import load_model
from worker.model.native import (
    INT16_BLOCK,
    INT16_WEIGHT_MAX,
    Int16Weight,
    NativeKernels,
    int16_layout,
)
from worker.model.packing import attach_int16_weights, pack_linear_layers
from worker.request import SamplingParams

X_MAX = 4095  # the kernel's |xq| (13-bit inputs)


@pytest.fixture(scope="module", params=kernel_builds(needs_avx2=True))
def ops(request: pytest.FixtureRequest) -> NativeKernels:
    """The products in each build this CPU runs that has them (tests/model/builds.py):
    its own, and the AVX2 kernel's (also built with AVX-512) where its own is the VNNI
    build."""
    kernels = load_build(request.param)
    # every CPU of this machine kind has AVX2 and FMA; those with AVX-512 VNNI get its build
    flags = read_cpu_flags()
    assert kernels.int16_built == ({"avx2", "fma"} <= flags)
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags and request.param == "native"
    assert kernels.int16_lanes == (16 if vnni else 8 if kernels.int16_built else 0)
    return kernels


@pytest.mark.parametrize("rows", [1, 5, 8, 64, 67, 300])
def test_the_avx2_and_vnni_builds_give_the_same_sums(rows: int) -> None:
    """The AVX2 build (column blocks of 8) and the AVX-512 VNNI one (blocks of 16) round
    the inputs alike and sum the same integer products in the same blocks: their outputs
    are equal bit for bit, whatever the build a CPU takes. Where this CPU has no VNNI its
    own build is the AVX2 one, and the test holds it against itself."""
    builds = kernel_builds(needs_avx2=True)
    avx2, own = load_build(builds[-1]), load_build("native")
    assert avx2.int16_lanes == 8
    g = torch.Generator().manual_seed(40 + rows)
    for k, n in ((576, 960), (1536, 576), (66, 48), (576, 64)):
        w = torch.randn(n, k, generator=g) * 0.05
        b = torch.randn(n, generator=g)
        x = torch.randn(rows, k, generator=g)
        want = avx2.linear_i16(x, int16_layout(w, 8), b)
        assert torch.equal(own.linear_i16(x, int16_layout(w, own.int16_lanes), b), want)


def _rounded_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: per row and block of INT16_BLOCK inputs, to the nearest
    of 2 * X_MAX + 1 steps spanning the block's largest |x| (float64, dequantized)."""
    M, K = x.shape
    out = torch.empty(M, K, dtype=torch.float64)
    for k0 in range(0, K, INT16_BLOCK):
        block = x[:, k0 : k0 + INT16_BLOCK]
        amax = block.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax * (1.0 / X_MAX), torch.ones_like(amax))
        inv = 1.0 / scale  # float32, as the kernel multiplies by it
        out[:, k0 : k0 + INT16_BLOCK] = torch.round(block * inv).double() * scale.double()
    return out


def _rounded_weight(w: torch.Tensor) -> torch.Tensor:
    iw = int16_layout(w)  # the rounding does not depend on the layout's lanes
    N, K = w.shape
    q = iw.wq.permute(0, 2, 1, 3).reshape(N, K)  # back to [N, K]
    return q.double() * iw.scale.double()[:, None]


@pytest.mark.parametrize("lanes", [8, 16])
def test_int16_layout_puts_a_block_of_columns_in_the_lanes(lanes: int) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 6, generator=g)
    iw = int16_layout(w, lanes)
    blocks = 32 // lanes
    assert iw.wq.shape == (blocks, 3, lanes, 2) and iw.lanes == lanes
    assert iw.wq.dtype == torch.int16 and iw.wq.is_contiguous()
    assert iw.scale.shape == (32,) and iw.out_features == 32 and iw.in_features == 6
    q = torch.round(w / iw.scale[:, None]).to(torch.int16)
    # wq[b][p][j][e] = round(W[L b + j][2 p + e] / scale[L b + j])
    assert iw.wq[1, 2, 5, 1] == q[lanes + 5, 2 * 2 + 1]
    assert iw.wq[blocks - 1, 1, lanes - 1, 0] == q[31, 2]
    # each column's largest weight takes the full range; rounding within half a step
    assert torch.equal(iw.wq.abs().amax(dim=(1, 3)).flatten(), torch.full((32,), INT16_WEIGHT_MAX))
    err = (_rounded_weight(w) - w.double()).abs()
    assert bool((err <= iw.scale.double()[:, None] * 0.5 + 1e-12).all())
    with pytest.raises(ValueError, match=f"N % {lanes} == 0, even K"):
        int16_layout(torch.zeros(lanes + 4, 6), lanes)
    with pytest.raises(ValueError, match="float32"):
        int16_layout(torch.zeros(32, 6, dtype=torch.bfloat16), lanes)
    with pytest.raises(ValueError, match="blocks of 8 or 16 columns, not 4"):
        int16_layout(w, 4)
    # a weight is checked once, when it is made
    with pytest.raises(ValueError, match="contiguous int16 with L 8 or 16"):
        Int16Weight(iw.wq.to(torch.int32), iw.scale)
    with pytest.raises(ValueError, match="contiguous int16 with L 8 or 16"):
        Int16Weight(iw.wq[:, :, :4].contiguous(), iw.scale)
    with pytest.raises(ValueError, match="32 columns needs as many contiguous float32"):
        Int16Weight(iw.wq, iw.scale[:16])
    with pytest.raises(ValueError, match="32 columns needs as many contiguous float32"):
        Int16Weight(iw.wq, iw.scale.double())


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 7, 8, 13, 14, 64, 130])
@pytest.mark.parametrize(
    ("k", "n"), [(576, 960), (1536, 576), (66, 48), (2, 16), (130, 80), (64, 32), (576, 64)]
)
def test_linear_i16_computes_the_rounded_operands_products(
    ops: NativeKernels, rows: int, k: int, n: int
) -> None:
    """Row counts off the tiles (4 rows in the AVX2 build, 8 in the VNNI one: every count
    of rows left, 1 to 7) and past the 64-row chunk; column blocks in whole 3-block tiles
    and off them (1 and 2 left, in blocks of 8 or 16); inputs off the 64-input block."""
    g = torch.Generator().manual_seed(rows * 31 + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    got = ops.linear_i16(x, int16_layout(w, ops.int16_lanes))
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # exact integer sums, float32 only across blocks and in the scales; an input next to
    # the midpoint of two steps may round the other way in the kernel (its reciprocal of
    # the step is not computed as here): one step (7e-4) x 0.05 off for each such input
    want = _rounded_inputs(x) @ _rounded_weight(w).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops: NativeKernels) -> None:
    """Batch invariance: a sequence's logits must not move with the batch it decodes in
    (tiles of 4 or 8 rows, chunks of 64, the rounding run on several threads past 32K
    inputs)."""
    g = torch.Generator().manual_seed(17)
    w = int16_layout(torch.randn(576, 1536, generator=g) * 0.05, ops.int16_lanes)
    x = torch.randn(130, 1536, generator=g)
    whole = ops.linear_i16(x, w)
    for lo, hi in ((0, 1), (61, 66), (127, 130), (5, 130), (3, 12)):
        assert torch.equal(ops.linear_i16(x[lo:hi].contiguous(), w), whole[lo:hi])


def test_linear_i16_error_is_below_bfloat16s(ops: NativeKernels) -> None:
    """Against float64, with an outlier input column as LLM activations have: the error of
    int16 products is a fraction of bfloat16's (both operands rounded to bfloat16,
    float32 sums)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(960, 576, generator=g) * 0.05
    x = torch.randn(32, 576, generator=g)
    x[:, 7] *= 60.0  # one block's step widens; the others keep theirs
    exact = x.double() @ w.double().T
    got = ops.linear_i16(x, int16_layout(w, ops.int16_lanes)).double()
    bf16 = (x.bfloat16().float() @ w.bfloat16().float().T).double()

    def rel(t: torch.Tensor) -> float:
        return float((t - exact).norm() / exact.norm())

    assert rel(got) < 1e-3
    assert rel(got) < rel(bf16) / 3, (rel(got), rel(bf16))


def test_linear_i16_does_not_overflow_at_the_extremes(ops: NativeKernels) -> None:
    """Every input and weight at its largest magnitude, signs aligned: each block's int32
    sum is at its largest (64 x 8191 x 4095 < 2^31) and the result stays exact."""
    k, n = 1536, 16
    w = torch.ones(n, k)
    w[1::2] = -1.0  # odd columns: the most negative sums
    x = torch.full((3, k), 1e3)
    iw = int16_layout(w, ops.int16_lanes)
    got = ops.linear_i16(x, iw)
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    zero = ops.linear_i16(torch.zeros(2, k), iw)
    assert torch.count_nonzero(zero) == 0


def test_a_nan_or_infinity_reaches_its_rows_outputs(ops: NativeKernels) -> None:
    """As a float32 matmul would pass it on: a non-finite input makes its row's outputs
    NaN, not a silently finite result (the other rows keep theirs); zeros and values
    far below float32's normal range round to finite results."""
    g = torch.Generator().manual_seed(13)
    w = int16_layout(torch.randn(16, 128, generator=g), ops.int16_lanes)
    x = torch.randn(4, 128, generator=g)
    x[1, 70], x[2, 3] = float("nan"), float("inf")
    x[3] = 1e-40  # denormals: the block's step is held at float32's smallest normal
    got = ops.linear_i16(x, w)
    assert bool(got[1].isnan().all()) and bool(got[2].isnan().all())
    assert bool(got[0].isfinite().all()) and bool(got[3].isfinite().all())
    torch.testing.assert_close(got[0:1], ops.linear_i16(x[0:1].contiguous(), w))


def test_linear_i16_adds_the_bias(ops: NativeKernels) -> None:
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(5, 64, generator=g)
    iw = int16_layout(w, ops.int16_lanes)
    torch.testing.assert_close(ops.linear_i16(x, iw, b), ops.linear_i16(x, iw) + b)


@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (7, 200), (130, 1536), (2048, 1536)])
def test_the_down_projection_from_gate_and_up_equals_silu_then_the_products(
    ops: NativeKernels, rows: int, inter: int
) -> None:
    """linear_i16_silu computes silu(gate) * up as it rounds its inputs: the same values as
    silu_mul then linear_i16, bit for bit (full blocks, a row's short last block, groups
    of four rows and a partial one)."""
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4  # gates well into SiLU's tails
    gate_up[0, 0], gate_up[-1, 1] = -100.0, 100.0  # past exp's float32 range, both ways
    w = int16_layout(torch.randn(48, inter, generator=g) * 0.05, ops.int16_lanes)
    b = torch.randn(48, generator=g)
    want = ops.linear_i16(ops.silu_mul(gate_up), w, b)
    got = ops.linear_i16_silu(gate_up, w, b)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=f"rows of {inter} inputs"):
        ops.linear_i16_silu(gate_up[:, : 2 * inter - 2].contiguous(), w)


def test_linear_i16_refuses_what_it_cannot_read(ops: NativeKernels) -> None:
    w = torch.randn(16, 64)
    iw = int16_layout(w, ops.int16_lanes)
    with pytest.raises(TypeError, match="contiguous"):
        ops.linear_i16(torch.randn(3, 64).bfloat16(), iw)
    with pytest.raises(TypeError, match="contiguous"):
        ops.linear_i16(torch.randn(64, 3).T, iw)
    with pytest.raises(ValueError, match="rows of 64 inputs"):
        ops.linear_i16(torch.randn(3, 32), iw)
    with pytest.raises(ValueError, match="a bias of 16"):
        ops.linear_i16(torch.randn(3, 64), iw, torch.zeros(8))
    other = 24 - ops.int16_lanes  # the other build's layout
    with pytest.raises(ValueError, match=f"an int16 layout \\[{16 // ops.int16_lanes}, 32"):
        ops.linear_i16(torch.randn(3, 64), int16_layout(w, other))


def test_a_linear_takes_int16_products_only_with_the_c_ops(ops: NativeKernels) -> None:
    g = torch.Generator().manual_seed(9)
    lin = Linear(64, 32)
    lin.weight = torch.nn.Parameter(torch.randn(32, 64, generator=g), requires_grad=False)
    x = torch.randn(6, 64, generator=g)
    exact = torch.nn.functional.linear(x, lin.weight)
    lin.int16_weight = int16_layout(lin.weight, ops.int16_lanes)
    assert lin.path(None, None) == "torch" and lin.path(None, ops) == "int16"
    assert lin.path(4, ops) == "int16"  # whatever the rows
    assert torch.equal(lin.matmul(x), exact)  # no C ops: float32 as it was
    got = lin.matmul(x, ops=ops)
    assert not torch.equal(got, exact)  # rounded operands...
    assert float((got - exact).norm() / exact.norm()) < 1e-3  # ...close to float32


def test_attach_int16_weights_unpacks_and_detaches(tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir("qwen2")), dtype="float32")
    model = loaded.model
    pack_linear_layers(model, "auto", "cpu")
    decoder = [m for m in model.layers.modules() if isinstance(m, Linear)]
    said = attach_int16_weights(model, 16)
    assert "16-bit integer products" in said and f"{len(decoder)} float32 weights" in said
    assert all(m.int16_weight is not None and not m.packed for m in decoder)
    assert all(m.int16_weight.lanes == 16 for m in decoder if m.int16_weight is not None)
    assert attach_int16_weights(model, 0) == ""
    assert all(m.int16_weight is None for m in decoder)


def test_a_model_with_int16_linear_layers_keeps_float32s_logits(tiny_model_dir) -> None:
    """A whole forward pass (Qwen2: biases on q, k and v) through `--linear int16` against
    the same model's float32 layers: logits within a small fraction of their spread."""
    path = str(tiny_model_dir("qwen2"))
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 1000, (40,), generator=g).tolist()

    def logits(linear: str) -> torch.Tensor:
        cfg = EngineConfig(model=path, num_kv_blocks=16, linear=linear, attention="native")
        runner = ModelRunner(cfg, load_model(path, dtype="float32"))
        assert ("16-bit integer products" in runner.info.linear) == (linear == "int16")
        step = ScheduledRequest(
            request_id="a",
            token_ids=ids,
            start=0,
            num_new_tokens=len(ids),
            block_ids=list(range(4)),
            num_prompt_tokens=len(ids),
            sampling_params=SamplingParams(temperature=0.0),
            eos_token_ids=(),
        )
        return runner.all_logits([step])["a"]  # [40, V]

    exact, int16 = logits("torch"), logits("int16")
    assert exact.shape == int16.shape == (40, exact.shape[1])
    assert not torch.equal(exact, int16)
    assert float((int16 - exact).abs().max() / exact.std()) < 0.02


def test_auto_takes_int16_only_for_float32_it_chose(tiny_model_dir) -> None:
    """A float32 model loaded as auto's choice computes as int16 products on a CPU whose
    widest vectors are AVX2 or one with AVX-512 VNNI (nowhere else), from a bfloat16 KV
    cache; the same model loaded as float32 asked for stays float32 on every CPU."""
    path = str(tiny_model_dir("llama3"))
    flags = read_cpu_flags()
    takes = "avx2" in flags and ("avx512f" not in flags or "avx512_vnni" in flags)
    cfg = EngineConfig(model=path, num_kv_blocks=16, attention="native")
    loaded = load_model(path, dtype="float32")
    chosen = ModelRunner(cfg, dataclasses.replace(loaded, auto_dtype=True))
    assert ("16-bit integer products" in chosen.info.linear) == takes, chosen.info.linear
    # behind int16 layers the cache the C kernel reads in place is bfloat16
    assert chosen.kv_dtype == (torch.bfloat16 if takes else torch.float32)
    assert chosen.info.kv_cache_dtype.startswith(
        "bfloat16 (auto: int16 linear layers" if takes else "float32 (auto"
    )
    asked = ModelRunner(cfg, loaded)  # auto_dtype False: float32 was asked for
    assert "16-bit integer products" not in asked.info.linear
    assert asked.kv_dtype == torch.float32
    assert all(m.int16_weight is None for m in loaded.model.modules() if isinstance(m, Linear))


def test_explicit_int16_needs_float32_layers(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen2"))
    cfg = EngineConfig(model=path, num_kv_blocks=16, linear="int16")
    with pytest.raises(ValueError, match="linear 'int16' computes float32 linear layers"):
        ModelRunner(cfg, load_model(path, dtype="bfloat16"))
    with pytest.raises(ValueError, match="linear 'int16' is for CPU"):
        EngineConfig(model=path, device="cuda", linear="int16")
