"""Linear layers with narrower weights than activations (bf16 weights, float32 stream)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.llama import Linear, padded_rows


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
