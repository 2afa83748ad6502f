"""Linear layers with narrower weights than activations (bf16 weights, float32 stream)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.model.llama import NARROW_HEAD_MIN_HIDDEN, RESCORED, Linear, padded_rows
from worker.model.loader import load_model
from worker.model.native import load_native


def test_padded_rows_are_few_buckets_never_below_the_need() -> None:
    buckets = {padded_rows(n) for n in range(1, 2049)}
    assert len(buckets) <= 32
    for n in range(1, 2049):
        assert n <= padded_rows(n) <= max(n + 7, n * 9 // 8 + 127)


def test_mixed_dtype_linear_equals_the_bf16_matmul_on_every_row_count() -> None:
    g = torch.Generator().manual_seed(11)
    lin = Linear(24, 40, bias=True)
    lin.weight.data = torch.randn(40, 24, generator=g).bfloat16()
    lin.bias.data = torch.randn(40, generator=g).bfloat16()  # type: ignore[union-attr]
    for rows in (1, 7, 9, 63, 65, 300):
        x = torch.randn(rows, 24, generator=g)  # float32 activations
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 40)
        want = F.linear(x.bfloat16(), lin.weight, lin.bias).float()
        # One bf16 rounding of the output apart at most, whatever kernel the CPU picks.
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_same_dtype_linear_is_a_plain_linear() -> None:
    g = torch.Generator().manual_seed(12)
    lin = Linear(8, 5)
    lin.weight.data = torch.randn(5, 8, generator=g)
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)


@pytest.mark.parametrize("c_pass", [False, True])
@pytest.mark.parametrize("variant", ["smollm2", "llama3"])  # tied and untied output weights
def test_a_narrow_output_projection_keeps_the_winning_candidates_exact(
    tiny_model_dir: Callable[[str], Path], variant: str, c_pass: bool
) -> None:
    """bfloat16 logits everywhere, float32's own scores for each row's best RESCORED;
    through torch, or with the C kernels (the logits widened and their candidates picked
    in one pass: kernels/logits.c)."""
    ops = load_native().kernels if c_pass else None
    assert ops is not None or not c_pass, "the C kernels build wherever these tests run"
    model = load_model(str(tiny_model_dir(variant)), dtype="bfloat16").model
    # Too small a hidden size for the loader to narrow the projection (below).
    assert model.config.hidden_size < NARROW_HEAD_MIN_HIDDEN and model.narrow_head is None
    model.narrow_output_projection(torch.bfloat16)
    assert model.narrow_head is not None
    weight = model.output_weight
    assert weight.dtype == torch.float32 and model.narrow_head.weight.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(37, weight.shape[1], generator=g)
    with torch.inference_mode():
        got = model.compute_logits(hidden, ops)
        h = model.norm(hidden)
        exact = h @ weight.T  # [S, V] float32
        narrow = F.linear(h.bfloat16(), weight.bfloat16()).float()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    # bfloat16 logits tie often: any RESCORED of the columns tied at a row's RESCORED-th
    # best value may be the ones scored again, but every column above it must be.
    kth = narrow.topk(RESCORED, dim=-1).values[:, -1:]  # [S, 1]
    above, candidates = narrow > kth, narrow >= kth  # [S, V]
    torch.testing.assert_close(got[above], exact[above], rtol=1e-5, atol=1e-5)
    is_exact = (got - exact).abs() <= 1e-5 + 1e-5 * exact.abs()
    assert ((is_exact & candidates).sum(-1) >= RESCORED).all()
    rest = ~candidates
    torch.testing.assert_close(got[rest], narrow[rest], rtol=1e-2, atol=1e-2)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("variant", ["smollm2", "llama3"])  # tied and untied output weights
def test_greedy_tokens_are_the_argmax_of_the_logits(
    tiny_model_dir: Callable[[str], Path], variant: str
) -> None:
    """With a bfloat16 narrow head on the C kernels, greedy_tokens picks what argmax over
    compute_logits picks, row by row, without widening the logits; elsewhere (no kernels,
    no narrow head) the model says it cannot, and refuses."""
    ops = load_native().kernels
    assert ops is not None, "the C kernels build wherever these tests run"
    model = load_model(str(tiny_model_dir(variant)), dtype="bfloat16").model
    g = torch.Generator().manual_seed(23)
    hidden = torch.randn(41, model.config.hidden_size, generator=g) * 2
    with torch.inference_mode():
        assert model.narrow_head is None and not model.picks_greedily(ops)
        with pytest.raises(ValueError, match="narrow output projection"):
            model.greedy_tokens(hidden, ops)
        model.narrow_output_projection(torch.bfloat16)
        assert model.picks_greedily(ops) and not model.picks_greedily(None)
        got = model.greedy_tokens(hidden, ops)
        want = model.compute_logits(hidden, ops).argmax(-1)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


def test_a_float32_model_keeps_one_output_projection(tiny_model_dir: Callable[[str], Path]) -> None:
    model = load_model(str(tiny_model_dir("smollm2")), dtype="float32").model
    assert model.narrow_head is None
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model.norm(hidden) @ model.embed_tokens.weight.T
        torch.testing.assert_close(model.compute_logits(hidden), want)
