"""The C prompt kernels equal causal SDPA over the same keys, read in place from scattered
cache blocks, and refuse what their tiles do not hold: kernels/prefill_attention.c over keys
in rows, kernels/prefill_pairs.c over bfloat16 keys in pairs (bfloat16 products)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.test_native import to_pairs
from worker.model.native import NativeKernels, prefill_kernel_fits


def _case(T: int, context: int, heads: int, kv_heads: int, dim: int, bs: int, seed: int):
    """A chunk of T rows after `context` cached keys: q [T, H, D], the caches with the
    sequence's blocks scattered among others, its block table (int32)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-(context + T) // bs)
    num_blocks = blocks + 9
    k_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=g)
    v_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:blocks].to(torch.int32)
    q = torch.randn(T, heads, dim, generator=g)
    return q, k_cache, v_cache, table


def _reference(q, k_cache, v_cache, table, context: int, scale: float) -> torch.Tensor:
    """SDPA over the sequence's keys gathered in order, row i seeing keys 0..context + i."""
    T, _, dim = q.shape
    kv_heads = k_cache.shape[1]
    total = context + T

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [KVH, total, D] float32
        rows = cache[table.long()].float().permute(1, 0, 2, 3)
        return rows.reshape(kv_heads, -1, dim)[:, :total]

    mask = torch.arange(total)[None, :] <= torch.arange(context, total)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        gather(k_cache)[None],
        gather(v_cache)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [T, H, D]


# Rows around the tile of 8 and chunks of 64 keys, contexts that end mid-block and
# mid-chunk; head dims that take the 64-value tiles (AVX-512 builds), the 32-value ones,
# their 8-value tail, or several of them (80: 64 + 16, 96: 64 + 32); groups of 1 to 8
# query heads per KV head.
CASES = [
    (1, 0, 9, 3, 64, 16),
    (7, 0, 9, 3, 64, 16),
    (9, 5, 9, 3, 64, 16),
    (64, 0, 9, 3, 64, 16),
    (65, 63, 9, 3, 64, 16),
    (130, 100, 9, 3, 64, 16),
    (17, 33, 4, 2, 16, 4),
    (40, 3, 4, 4, 40, 8),
    (23, 70, 8, 1, 128, 64),
    (12, 0, 32, 8, 64, 32),
    (11, 20, 10, 2, 80, 16),
    (5, 40, 6, 3, 96, 16),
]


@pytest.mark.parametrize(("T", "context", "heads", "kv_heads", "dim", "bs"), CASES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_prompt_kernel_equals_causal_sdpa(
    T: int,
    context: int,
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
    cache_dtype: torch.dtype,
    kernels: NativeKernels,
) -> None:
    assert prefill_kernel_fits(heads, kv_heads, dim, bs)
    q, k_cache, v_cache, table = _case(T, context, heads, kv_heads, dim, bs, seed=T + context)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = dim**-0.5
    got = torch.full_like(q, float("nan"))
    kernels.prefill_attention(q, k_cache, v_cache, table, context, got, scale)
    want = _reference(q, k_cache, v_cache, table, context, scale)  # on the same values
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_prompt_kernel_refuses_what_its_tiles_do_not_hold(kernels: NativeKernels) -> None:
    assert not prefill_kernel_fits(18, 2, 64, 16)  # 9 query heads per KV head
    assert not prefill_kernel_fits(9, 3, 60, 16)  # head dim not a multiple of 8
    assert not prefill_kernel_fits(9, 3, 64, 128)  # blocks longer than a chunk of keys
    assert not prefill_kernel_fits(9, 2, 64, 16)  # heads that do not group
    q, k_cache, v_cache, table = _case(8, 0, 18, 2, 64, 16, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="does not take 18 heads over 2 KV heads"):
        kernels.prefill_attention(q, k_cache, v_cache, table, 0, out, 0.125)
    q, k_cache, v_cache, table = _case(8, 20, 9, 3, 64, 16, seed=2)
    with pytest.raises(ValueError, match="int32 block table of >= 2 blocks"):
        kernels.prefill_attention(q, k_cache, v_cache, table[:1], 20, torch.empty_like(q), 0.125)
    with pytest.raises(TypeError, match="float32, bfloat16 or int8"):
        kernels.prefill_attention(q, k_cache.half(), v_cache.half(), table, 20, q, 0.125)


# Keys in pairs: the rows' cases whose shapes the pairs' tiles take, and a long chunk,
# a head dim of three tiles of 32 values with 5 query heads a KV head, and one of a single
# tile: rows around the tile of 8 and chunks of 64 keys, contexts that end mid-block and
# mid-chunk, blocks of 16 to 64 keys (several runs of 16 a block), 1 to 8 query heads a
# KV head.
@pytest.mark.parametrize(
    ("T", "context", "heads", "kv_heads", "dim", "bs"),
    [c for c in CASES if prefill_kernel_fits(*c[2:], pairs=True)]
    + [(300, 0, 9, 3, 64, 16), (11, 20, 10, 2, 96, 16), (33, 17, 4, 4, 32, 32)],
)
def test_prompt_kernel_over_keys_in_pairs_equals_causal_sdpa(
    T: int, context: int, heads: int, kv_heads: int, dim: int, bs: int, kernels: NativeKernels
) -> None:
    """Bfloat16 products, q * scale and the softmax's weights rounded to bfloat16: within
    bfloat16's rounding of the float32 kernel's result (q and the values are of unit scale,
    so that a wrong key, a missed mask or a misplaced value moves outputs by ~0.1-1)."""
    assert prefill_kernel_fits(heads, kv_heads, dim, bs, pairs=True)
    q, k_cache, v_cache, table = _case(T, context, heads, kv_heads, dim, bs, seed=T + 7 * context)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    scale = dim**-0.5
    got = torch.full_like(q, float("nan"))
    if not kernels.prefill_pairs_built:  # a build for a CPU without avx512_bf16
        with pytest.raises(RuntimeError, match="needs avx512_bf16"):
            kernels.prefill_attention(q, to_pairs(k16), v16, table, context, got, scale)
        return
    kernels.prefill_attention(q, to_pairs(k16), v16, table, context, got, scale)
    want = _reference(q, k16, v16, table, context, scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # the rows' bfloat16 products: q rounded once, as here
    rounded = _reference((q * scale).bfloat16().float(), k16, v16, table, context, 1.0)
    assert (got - rounded).abs().mean() < 0.5 * (got - want).abs().mean() + 1e-3


def test_prompt_kernel_over_keys_in_pairs_refuses_what_its_tiles_do_not_hold(
    kernels: NativeKernels,
) -> None:
    assert not prefill_kernel_fits(9, 3, 80, 16, pairs=True)  # head dim not a multiple of 32
    assert not prefill_kernel_fits(9, 3, 64, 8, pairs=True)  # blocks of fewer than 16 keys
    assert not prefill_kernel_fits(18, 2, 64, 16, pairs=True)  # 9 query heads per KV head
    assert prefill_kernel_fits(9, 3, 64, 128, pairs=True)  # long blocks: runs of 16
    q, k_cache, v_cache, table = _case(8, 0, 9, 3, 80, 16, seed=3)
    k16, v16 = to_pairs(k_cache.bfloat16()), v_cache.bfloat16()
    out = torch.empty_like(q)
    if kernels.prefill_pairs_built:
        with pytest.raises(ValueError, match="of 80 in blocks of 16 with keys in pairs"):
            kernels.prefill_attention(q, k16, v16, table, 0, out, 0.1)
    # values other than the keys' dtype (int8 values behind keys in pairs)
    v8 = torch.zeros(*v_cache.shape[:3], 80 + 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="keys and values alike"):
        kernels.prefill_attention(q, k16, v8, table, 0, out, 0.1)
