"""The C layer ops (RMSNorm, rotary + K/V store, SiLU and multiply) equal the torch ops
they replace, on the calling thread and on the OpenMP path (256 tokens and more)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.llama import RMSNorm, Rotary
from worker.model.native import NativeKernels, load_native


@pytest.fixture(scope="module")
def ops() -> NativeKernels:
    loaded = load_native()
    assert loaded.kernels is not None, loaded.reason
    return loaded.kernels


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_equals_the_module(ops: NativeKernels, tokens: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=g) * 3
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [5, 300])
def test_rms_norm_writes_bfloat16_rows_padded_with_zeros(ops: NativeKernels, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    out = ops.rms_norm(x, norm.weight, 1e-6, out_dtype=torch.bfloat16, rows=tokens + 3)
    assert out.shape == (tokens + 3, 64) and out.dtype == torch.bfloat16
    # one bfloat16 step at most (float32 sums in another order can round the other way)
    torch.testing.assert_close(out[:tokens].float(), norm(x), rtol=2**-8, atol=1e-6)
    assert torch.count_nonzero(out[tokens:]) == 0


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 300])
def test_add_rms_norm_adds_in_place_then_normalises(
    ops: NativeKernels, tokens: int, residual_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    # a padded residual, as a linear layer's output comes: only the first T rows count
    delta = torch.randn(tokens + 5, 64, generator=g).to(residual_dtype)
    w = torch.rand(64, generator=g) + 0.5
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = w
    expected_x = x + delta[:tokens].float()
    out = ops.rms_norm(x, w, 1e-6, residual=delta)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(out, norm(expected_x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 300])
def test_silu_mul_equals_torch(ops: NativeKernels, tokens: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 96, generator=g) * 4).to(dtype)
    gate, up = gate_up.float().split(96, dim=-1)
    out = ops.silu_mul(gate_up, dtype)
    assert out.dtype == dtype
    tol = {"rtol": 2**-8, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).to(dtype).float(), **tol)


def _ties(n: int, g: torch.Generator) -> torch.Tensor:
    """float32 values whose low 16 bits are exactly half a bfloat16 step (rounding ties),
    both parities of the kept bit, and ordinary values."""
    mantissa = torch.randint(0, 1 << 7, (n,), generator=g, dtype=torch.int32) << 16  # bf16's
    exponent = torch.randint(120, 134, (n,), generator=g, dtype=torch.int32) << 23
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
    low = torch.full((n,), 0x8000, dtype=torch.int32)  # a tie: to even
    low[1::2] = torch.randint(0, 1 << 16, (n // 2,), generator=g, dtype=torch.int32)
    return (sign | exponent | mantissa | low).view(torch.float32)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 300])
def test_rope_store_rotates_and_stores_k_and_v(
    ops: NativeKernels, cache_dtype: torch.dtype, qkv_dtype: torch.dtype, tokens: int
) -> None:
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 64, 16, 64
    g = torch.Generator().manual_seed(tokens)
    # padded rows past the T tokens, as a linear layer's output comes
    qkv = torch.randn(tokens + 3, (heads + 2 * kv_heads) * dim, generator=g)
    qkv[:tokens, (heads + kv_heads) * dim :] = _ties(tokens * kv_heads * dim, g).view(tokens, -1)
    qkv = qkv.to(qkv_dtype)
    before = qkv.clone()
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos(), freqs.sin()  # [T, D/2]

    q, k, v = qkv[:tokens].float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref = Rotary.rotate(q.reshape(tokens, heads, dim), cos[:, None], sin[:, None])
    k_ref = Rotary.rotate(k.reshape(tokens, kv_heads, dim), cos[:, None], sin[:, None])
    v_ref = v.reshape(tokens, kv_heads, dim)
    k_cache = torch.zeros(num_blocks, kv_heads, bs, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)

    out = ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads)

    assert out.shape == (tokens, qkv.shape[1]) and out.dtype == torch.float32
    assert torch.equal(qkv, before)  # its input is left as it was
    rotated = out.view(tokens, heads + 2 * kv_heads, dim)
    torch.testing.assert_close(rotated[:, :heads], q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotated[:, heads : heads + kv_heads], k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(rotated[:, heads + kv_heads :], v_ref)  # widened exactly
    # The cache holds the kernel's own rotated k and v, rounded as torch rounds to the
    # cache's dtype: bit for bit, ties included.
    stored_k = k_cache[slots // bs, :, slots % bs]  # [T, KVH, D]
    stored_v = v_cache[slots // bs, :, slots % bs]
    assert torch.equal(stored_k, rotated[:, heads : heads + kv_heads].to(cache_dtype))
    assert torch.equal(stored_v, v_ref.to(cache_dtype))
    # nothing written outside the tokens' slots
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    untouched = k_cache.permute(0, 2, 1, 3).reshape(num_blocks * bs, -1)[~written]
    assert torch.count_nonzero(untouched) == 0


def test_layer_ops_refuse_rows_they_cannot_read(ops: NativeKernels) -> None:
    x = torch.randn(8, 64)
    with pytest.raises(TypeError, match="contiguous"):
        ops.rms_norm(x.t().contiguous().t(), torch.ones(64), 1e-6)
    with pytest.raises(TypeError, match="float16"):
        ops.silu_mul(torch.randn(8, 64).half())
