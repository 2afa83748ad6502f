"""The C row kernel for bfloat16 linear layers of up to a few hundred rows (decode steps,
short prompt chunks): it equals the matmul it replaces at every tile edge, gives a row the
same result whatever else is in the batch, runs only where it was built for, and the
Linear takes it only up to ROWS_KERNEL_MAX real rows."""

from __future__ import annotations

import pytest
import torch

from tests.model.builds import AMX_EMULATED, kernel_builds, load_build
from worker.hardware import read_cpu_flags
from worker.model.candidates import top_candidates
from worker.model.llama import ROWS_KERNEL_MAX, Linear, LlamaForCausalLM
from worker.model.native import NativeKernels, rows_layout
from worker.model.packing import attach_rows_weights


@pytest.fixture(scope="module", params=["native", AMX_EMULATED])
def ops(request: pytest.FixtureRequest) -> NativeKernels:
    """This CPU's build and, where it has no AMX, the same with the tiles emulated (the
    AMX slabs' code, checked here; on a CPU with AMX its own build takes them)."""
    if request.param == AMX_EMULATED and AMX_EMULATED not in kernel_builds(variants=True):
        return load_build("native")  # AMX here: the native build runs the real tiles
    return load_build(request.param)


def _built_here() -> bool:
    flags = read_cpu_flags()
    return "avx512_bf16" in flags


def _computes(ops: NativeKernels) -> bool:
    """Whether the kernel is built here; on the other CPUs it says so rather than
    computing."""
    if not _built_here():
        assert not ops.matmul_rows_built
        return False
    return True


def test_the_kernel_is_built_where_the_cpu_has_avx512_bf16(ops: NativeKernels) -> None:
    assert ops.matmul_rows_built == _built_here()
    # on AMX tiles where the CPU has them (Linux grants them to any process that asks)
    emulated = ops.path.name != load_build("native").path.name
    assert ops.matmul_rows_amx == ("amx_bf16" in read_cpu_flags() or emulated)


def test_rows_layout_puts_16_columns_in_the_lanes() -> None:
    w = torch.arange(32 * 6, dtype=torch.float32).view(32, 6)
    wp = rows_layout(w)
    assert wp.shape == (2, 3, 16, 2) and wp.dtype == torch.bfloat16 and wp.is_contiguous()
    # wp[b][p][j][e] = W[16 b + j][2 p + e]
    assert wp[1, 2, 5, 1] == w[16 + 5, 2 * 2 + 1]
    assert wp[0, 1, 15, 0] == w[15, 2]
    with pytest.raises(ValueError, match="N % 16 == 0 and K even"):
        rows_layout(torch.zeros(24, 6))


# Row counts at and around the tiles' edges (tiles of 6 rows, the next panel asked for
# from 12; AMX slabs of 16 and 32), and column counts whose shares (one a thread, by the
# column block of 16, or by pairs of them on AMX) end in a full tile of 4 blocks or in a
# part of one, or in a block alone; 16 x 8 blocks give two threads a full tile each and
# no next panel, 16 x 101 every thread full tiles and a part on up to 16 threads, one
# block leaves every thread but one without work. Inputs of a multiple of 32 go to the
# AMX tiles where the CPU has them; 48 and 80 take the vector tiles there too.
@pytest.mark.parametrize("tokens", [1, 3, 5, 6, 7, 11, 12, 13, 16, 18, 32, 37, 64, 130])
@pytest.mark.parametrize(
    ("k", "n"),
    [
        (576, 960),
        (1536, 576),
        (64, 48),
        (32, 16 * 13),
        (64, 16 * 101),
        (64, 16 * 8),
        (64, 16),
        (48, 64),
        (80, 16 * 3),
    ],
)
def test_matmul_rows_equals_the_matmul(ops: NativeKernels, tokens: int, k: int, n: int) -> None:
    if not _computes(ops):
        return
    g = torch.Generator().manual_seed(tokens * 7 + k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    rows = max(8, tokens)
    x = torch.full((rows, k), 5.0, dtype=torch.bfloat16)  # padding rows: never read
    x[:tokens] = torch.randn(tokens, k, generator=g).bfloat16()
    got = ops.matmul_rows(x, rows_layout(w), tokens)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert torch.count_nonzero(got[tokens:]) == 0  # padding rows zeroed
    # products exact, sums in float32, one rounding to bfloat16 at the end
    want = x[:tokens].float() @ w.float().T
    torch.testing.assert_close(got[:tokens].float(), want, rtol=8e-3, atol=1e-3)


def test_a_row_gets_the_same_result_whatever_else_is_in_the_batch(ops: NativeKernels) -> None:
    """Each output is one sum in one order whatever the tile, the row count or the thread
    that computes it: a sequence's logits do not move with the batch it decodes in."""
    if not _computes(ops):
        return
    g = torch.Generator().manual_seed(11)
    w = rows_layout((torch.randn(960, 576, generator=g) * 0.05).bfloat16())
    x = torch.randn(67, 576, generator=g).bfloat16()
    whole = ops.matmul_rows(x, w, 67)
    for row in (0, 5, 33, 66):
        alone = ops.matmul_rows(x[row : row + 1].contiguous(), w, 1)
        assert torch.equal(alone[0], whole[row])
    assert torch.equal(ops.matmul_rows(x[:9].contiguous(), w, 9), whole[:9])


def test_sums_are_rounded_to_bfloat16_as_torch_rounds(ops: NativeKernels) -> None:
    """Sums exact in float32 (two bfloat16 products of 1.0) that bfloat16 cannot hold:
    halfway cases go to the even neighbour, past the largest finite value to inf, and a
    sign stays; each equal to torch's rounding of the same float32 sum."""
    if not _computes(ops):
        return
    tie = 2.0**-8  # half a bfloat16 step at 1.0
    big = float(torch.finfo(torch.bfloat16).max)
    pairs = [
        (1.0, tie),  # 1 + 2^-8: a tie, down to the even 1.0
        (1.0 + 2 * tie, tie),  # a tie, up to the even 1 + 2^-6
        (1.0, tie * 1.5),  # past the tie: up
        (-1.0, -tie),  # a negative tie
        (big, 2.0**119),  # halfway past the largest finite value: to the even, inf
        (-big, -(2.0**119)),
        (3.0, 0.0),  # exact
        (0.0, 0.0),
    ]
    n = 16 * 2
    w = torch.zeros(n, 2)
    for j, (a, b) in enumerate(pairs):
        w[j] = torch.tensor([a, b])
    w = w.bfloat16()
    for k in (2, 32):  # the vector tiles; the AMX tiles where the CPU has them
        wk = torch.zeros(n, k, dtype=torch.bfloat16)
        wk[:, :2] = w
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        x[0, :2] = 1.0
        got = ops.matmul_rows(x, rows_layout(wk), 1)[0]
        want = (w.float() @ x.float()[0, :2]).bfloat16()  # the float32 sums, exact, rounded
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (k, got[:8])
        assert got[4] == float("inf") and got[5] == float("-inf") and got[0] == 1.0


def test_a_nan_input_gives_nan_outputs_in_its_row_only(ops: NativeKernels) -> None:
    if not _computes(ops):
        return
    g = torch.Generator().manual_seed(12)
    w = rows_layout((torch.randn(96, 64, generator=g) * 0.05).bfloat16())
    x = torch.randn(6, 64, generator=g).bfloat16()
    x[2, 7] = float("nan")
    got = ops.matmul_rows(x, w, 6)
    assert bool(got[2].isnan().all())
    assert not bool(got[[0, 1, 3, 4, 5]].isnan().any())


def test_matmul_rows_refuses_what_it_cannot_take(ops: NativeKernels) -> None:
    if not _built_here():
        assert not ops.matmul_rows_built
        with pytest.raises(ValueError, match="not built for this CPU"):
            ops.matmul_rows(torch.randn(8, 64).bfloat16(), rows_layout(torch.randn(32, 64)), 4)
        return
    w = rows_layout(torch.randn(32, 64))
    x = torch.randn(8, 64).bfloat16()
    with pytest.raises(ValueError, match=r"1\.\.8 rows"):
        ops.matmul_rows(x, w, 0)
    with pytest.raises(ValueError, match=r"1\.\.8 rows"):
        ops.matmul_rows(x, w, 9)
    with pytest.raises(ValueError, match="rows layout"):
        ops.matmul_rows(torch.randn(8, 32).bfloat16(), w, 4)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        ops.matmul_rows(x.float(), w, 4)


class _Refusing:
    """Stands in for the kernels where a test needs to know the row kernel was not taken."""

    def matmul_rows(self, *args: object) -> torch.Tensor:
        raise AssertionError("the row kernel was called")

    def widen_top(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the C pass over a narrow head's logits returns, as torch's path makes it."""
        wide = x.float()
        return wide, top_candidates(wide, width)[1]


def test_linear_takes_the_kernel_up_to_its_row_limit_only(ops: NativeKernels) -> None:
    g = torch.Generator().manual_seed(5)
    m = Linear(64, 96)
    m.weight = torch.nn.Parameter((torch.randn(96, 64, generator=g) * 0.05).bfloat16())
    rows = ROWS_KERNEL_MAX + 8
    x = torch.zeros(rows, 64, dtype=torch.bfloat16)
    x[:12] = torch.randn(12, 64, generator=g).bfloat16()
    plain = m.matmul(x)
    refusing: NativeKernels = _Refusing()  # type: ignore[assignment]
    # no copy in the kernel's layout, or more than ROWS_KERNEL_MAX real rows: the plain matmul
    assert torch.equal(m.matmul(x, 4, refusing), plain)
    assert m.path(4, refusing) == "torch"
    m.rows_weight = rows_layout(m.weight)
    # the path matmul takes, as the layer stack asks it
    assert m.path(ROWS_KERNEL_MAX, refusing) == "rows" and m.path(1, refusing) == "rows"
    assert m.path(ROWS_KERNEL_MAX + 1, refusing) == m.path(None, refusing) == "torch"
    assert m.path(4, None) == "torch"
    assert torch.equal(m.matmul(x, ROWS_KERNEL_MAX + 1, refusing), plain)
    assert torch.equal(m.matmul(x, None, refusing), plain)
    with pytest.raises(AssertionError, match="the row kernel was called"):
        m.matmul(x, ROWS_KERNEL_MAX, refusing)  # at the limit: the kernel
    if _built_here():
        got = m.matmul(x, 12, ops)  # 12 real rows of `rows`: the kernel, padding zeroed
        assert got.shape == plain.shape and torch.count_nonzero(got[12:]) == 0
        torch.testing.assert_close(got[:12].float(), plain[:12].float(), rtol=8e-3, atol=1e-3)


def test_rows_weights_are_attached_where_the_kernel_is(ops: NativeKernels, tiny_model_dir) -> None:
    from worker.model.loader import load_model

    model = load_model(str(tiny_model_dir("smollm2")), dtype="bfloat16").model
    assert isinstance(model, LlamaForCausalLM)
    said = attach_rows_weights(model, ops)
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    if _built_here():
        assert "the C row kernel" in said
        takes = [m for m in linears if m.weight.shape[0] % 16 == 0 and m.bias is None]
        assert takes, "the tiny model's layers are shaped for the kernel"
        for m in linears:
            if m in takes:
                assert m.rows_weight is not None
                assert torch.equal(m.rows_weight, rows_layout(m.weight))
            else:
                assert m.rows_weight is None
    else:
        assert said.startswith("no row kernel") and "avx512_bf16" in said
        assert all(m.rows_weight is None for m in linears)
    # without the kernels (no C compiler, or the torch ops chosen) no copies are kept
    assert attach_rows_weights(model, None).startswith("no row kernel")
    assert all(m.rows_weight is None for m in linears)


def test_the_narrow_output_projection_takes_the_row_kernel(
    ops: NativeKernels, tiny_model_dir
) -> None:
    from worker.model.loader import load_model

    model = load_model(str(tiny_model_dir("smollm2")), dtype="bfloat16").model
    assert isinstance(model, LlamaForCausalLM)
    # the tiny model's hidden size is under the loader's threshold for a narrow head: made
    # here as the loader makes it for the default model
    assert model.output_weight.dtype == torch.float32
    model.narrow_output_projection(torch.bfloat16)
    assert isinstance(model.narrow_head, Linear)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    want = model.compute_logits(hidden)
    attach_rows_weights(model, ops)
    assert (model.narrow_head.rows_weight is not None) == _built_here()
    got = model.compute_logits(hidden, ops)
    # the best candidates are re-scored in float32 either way: the greedy picks agree
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    refusing: NativeKernels = _Refusing()  # type: ignore[assignment]
    many = torch.randn(ROWS_KERNEL_MAX + 1, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(many, refusing), model.compute_logits(many))
