"""The C decode kernel equals the torch path, and its absence is handled, not hidden."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import worker.model.native as native_mod
from tests.model.builds import kernel_builds, load_build, scores_on_tiles
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.hardware import INTEL, read_cpu_flags, read_cpu_vendor
from worker.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    InPlaceDecode,
    Workspace,
    decode_mask,
    dequantize_rows,
    paged_attention,
    quantize_rows,
    store_kv,
    widen,
)
from worker.model.native import (
    KERNELS,
    MARCH_FLAGS,
    NativeKernels,
    i8_group,
    kernel_defines,
    load_native,
    vendor_defines,
)


def _case(n: int, heads: int, kv_heads: int, dim: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 128
    k_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=g)
    v_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=g)
    lens = torch.randint(1, 6 * bs, (n,), generator=g)
    lens[0] = 1  # a sequence whose only key is its own
    max_blocks = int(-(-lens.max() // bs))
    # distinct blocks per sequence, in a scrambled order
    tables = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks)
    q = torch.randn(n, heads, dim, generator=g)
    return q, k_cache, v_cache, tables, lens


def _meta(
    groups: list[DecodeGroup],
    in_place: InPlaceDecode | None,
    bs: int,
) -> AttentionMetadata:
    empty = torch.empty(0, dtype=torch.int64)  # no new K/V: the caches are filled already
    return AttentionMetadata(
        slot_mapping=empty,
        slot_blocks=empty,
        slot_offsets=empty,
        decode_groups=groups,
        prefills=[],
        in_place=in_place,
        block_size=bs,
        workspace=Workspace(torch.device("cpu")),  # gathers of cache rows
    )


def _torch_path(q, k_cache, v_cache, tables, lens, bs, window):
    n, _, dim = q.shape
    kvh = k_cache.shape[1]
    rows = (tables[:, None, :] * kvh + torch.arange(kvh)[None, :, None]).reshape(-1)
    group = DecodeGroup(
        0, n, rows, tables.shape[1], decode_mask(lens, tables.shape[1] * bs, window)
    )
    meta = _meta([group], None, bs)
    no_kv = torch.empty(0, kvh, dim)
    return paged_attention(q, no_kv, no_kv, k_cache, v_cache, meta, dim**-0.5)


# Blocks of 16 and 32 keys take the kernel's 16-keys-at-a-time score path where the CPU
# has AVX-512 (a window starts runs mid-block: partial runs take the per-key path); 8
# query heads per KV head at D 64 hold more accumulators than it keeps in registers.
# With AVX2 a bfloat16 cache is read 4 keys and 3 query heads at a time, 32 values of a
# value row at a time: 1, 4, 6 and 8 heads a group and D 48 and 80 leave remainders of
# each, and windows and partial blocks runs of other than 4 keys. An int8 cache's keys
# are dequantized 16 values (a group) at a time, its values in registers where they fit.
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "bs"),
    [
        (9, 3, 64, None, 4),
        (4, 4, 128, None, 4),
        (8, 2, 32, None, 4),
        (6, 1, 64, 7, 4),
        (9, 3, 64, None, 16),
        (4, 4, 128, None, 16),
        (8, 2, 32, 21, 16),
        (16, 2, 64, None, 16),
        (6, 1, 64, 37, 32),
        (12, 3, 48, None, 16),
        (5, 5, 80, 19, 16),
    ],
)
def test_kernel_equals_the_torch_path(
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
    bs: int,
    cache_dtype: torch.dtype,
    kernels: NativeKernels,
) -> None:
    q, k_cache, v_cache, tables, lens = _case(11, heads, kv_heads, dim, bs, seed=heads * dim + bs)
    if cache_dtype == torch.int8:
        k_cache, v_cache = _int8_caches(k_cache, v_cache)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    # a narrow cache: the float32 path on the same (widened) values
    wide_k, wide_v = widen(k_cache, torch.float32, dim), widen(v_cache, torch.float32, dim)
    want = _torch_path(q, wide_k, wide_v, tables, lens, bs, window)
    got = torch.full_like(q, float("nan"))
    kernels.paged_decode(
        q,
        k_cache,
        v_cache,
        tables.to(torch.int32),
        lens.to(torch.int32),
        got,
        dim**-0.5,
        window or 0,
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_shares_sequences_or_pairs_between_threads(
    threads: int, kernels: NativeKernels
) -> None:
    """Sequences go whole to a thread (their KV heads in turn) where there are at least 4
    a thread, else (sequence, KV head) pairs: both orders give the torch path's output,
    bfloat16 cache included, for any thread count (CPU of any size: set here)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for n in (2, 4 * threads - 1, 4 * threads, 13):
            q, k_cache, v_cache, tables, lens = _case(n, 9, 3, 64, 16, seed=100 + n)
            k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
            for k, v in ((k_cache, v_cache), (k16, v16)):
                want = _torch_path(q, k.float(), v.float(), tables, lens, 16, None)
                got = torch.full_like(q, float("nan"))
                args = (tables.to(torch.int32), lens.to(torch.int32), got, 64**-0.5, 0)
                kernels.paged_decode(q, k, v, *args)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_kernel_reads_a_bfloat16_cache(kernels: NativeKernels) -> None:
    """With a bf16 cache the kernel computes in float32 on the cache's values: it equals
    the float32 path run on the same (widened) values. On a CPU with avx512_bf16 the
    scores take q cut into two bfloat16 halves (vdpbf16ps on the stored keys; the library
    says so): still within the float32 tolerance, where q rounded once was off by ~3e-3."""
    bs = 16
    q, k_cache, v_cache, tables, lens = _case(9, 9, 3, 64, bs, seed=11)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    # on where the CPU has the instruction (and the compiler knows it) and is not an Intel
    # core (by its vendor, or AMX or AVX-512 FP16 in its flags), where float32 FMAs on
    # widened keys are the faster; never elsewhere
    flags = read_cpu_flags()
    assert not kernels.bf16_scores or (
        "avx512_bf16" in flags
        and not {"amx_bf16", "avx512_fp16"} & flags
        and read_cpu_vendor() != INTEL
    )
    want = _torch_path(q, k16.float(), v16.float(), tables, lens, bs, None)
    got = torch.full_like(q, float("nan"))
    args = (tables.to(torch.int32), lens.to(torch.int32), got, 64**-0.5, 0)
    kernels.paged_decode(q, k16, v16, *args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(TypeError, match="float32, bfloat16 or int8"):
        kernels.paged_decode(q, k_cache.half(), v_cache.half(), *args)


def _kernel_equals_widened(kernels, q, k_cache, v_cache, tables, lens, bs, window) -> tuple:
    """The kernel over narrow caches (bfloat16, int8 rows or both) equals the float32 path
    on their widened values, and so does the torch gather path, which widens in torch.
    The kernel's remaining arguments, for the caller's refusals."""
    dim = q.shape[-1]
    wide_k, wide_v = widen(k_cache, torch.float32, dim), widen(v_cache, torch.float32, dim)
    want = _torch_path(q, wide_k, wide_v, tables, lens, bs, window)
    got = torch.full_like(q, float("nan"))
    args = (tables.to(torch.int32), lens.to(torch.int32), got, dim**-0.5, window or 0)
    kernels.paged_decode(q, k_cache, v_cache, *args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        _torch_path(q, k_cache, v_cache, tables, lens, bs, window), want, atol=1e-6, rtol=1e-6
    )
    return args


def _int8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """The float32 caches as an int8 cache holds them: keys with a scale per 16 values
    (per row where D is not a multiple of 16), values with one per row."""
    dim = k_cache.shape[-1]
    return quantize_rows(k_cache, i8_group(dim, keys=True)), quantize_rows(v_cache)


def test_kernel_reads_an_int8_cache(kernels: NativeKernels) -> None:
    """An int8 cache (keys as rows of D values and a float32 scale per 16 of them, values
    with one scale per row): the kernel equals the float32 path run on the dequantized
    values, scores and sums in float32, and so does the torch gather path."""
    shapes = ((8, 4, 2, 24, None, 28), (4, 8, 2, 32, 5, 32 + 8), (16, 9, 3, 64, None, 64 + 16))
    for bs, heads, kv_heads, dim, window, key_row in shapes:
        q, k_cache, v_cache, tables, lens = _case(9, heads, kv_heads, dim, bs, seed=bs + dim)
        k8, v8 = _int8_caches(k_cache, v_cache)
        assert k8.shape == (*k_cache.shape[:3], key_row) and k8.dtype == torch.int8
        assert v8.shape == (*k_cache.shape[:3], dim + 4) and v8.dtype == torch.int8
        args = _kernel_equals_widened(kernels, q, k8, v8, tables, lens, bs, window)
    # D 64: the keys' rows (80 bytes) and the values' (68) are not each other's
    with pytest.raises(ValueError, match="cache rows of 80"):
        kernels.paged_decode(q, v8, v8, *args)
    with pytest.raises(ValueError, match="cache rows of 68"):
        kernels.paged_decode(q, k8, k8, *args)


def test_int8_key_rows_keep_each_group_within_half_its_step() -> None:
    """Keys rounded in groups of 16 values, each against its own largest value: a group of
    small values beside a large one keeps its precision (one scale per row would round
    them to a few steps), and every value is within half its group's step."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    x[:, :16] *= 100.0  # one loud group per row
    rows = quantize_rows(x, 16)
    assert rows.shape == (6, 64 + 16)
    back = dequantize_rows(rows, torch.float32, 64)
    step = x.unflatten(-1, (4, 16)).abs().amax(-1, keepdim=True) / 127  # [6, 4, 1]
    err = (back - x).unflatten(-1, (4, 16)).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()
    whole = dequantize_rows(quantize_rows(x), torch.float32, 64)
    assert (whole - x)[:, 16:].abs().amax() > 10 * err[:, 1:].amax()


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_reads_bfloat16_keys_over_int8_values(threads: int, kernels: NativeKernels) -> None:
    """Keys bfloat16, values int8 rows with their scale: the kernel equals the float32
    path on the widened keys and the dequantized values (the torch gather path too), with
    sequences to a thread or (sequence, KV head) pairs; a pair the kernel has no entry for
    is refused, not misread."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        shapes = ((16, 9, 3, 64, None, 9), (4, 8, 2, 32, 5, 13), (16, 4, 4, 128, None, 3))
        for bs, heads, kv_heads, dim, window, n in shapes:
            q, k_cache, v_cache, tables, lens = _case(n, heads, kv_heads, dim, bs, seed=dim + n)
            k16, v8 = k_cache.bfloat16(), quantize_rows(v_cache)
            args = _kernel_equals_widened(kernels, q, k16, v8, tables, lens, bs, window)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(TypeError, match=r"int8 keys over torch\.bfloat16 values"):
        kernels.paged_decode(q, _int8_caches(k_cache, v_cache)[0], k16, *args)
    with pytest.raises(ValueError, match=f"cache rows of {dim + 4}"):
        kernels.paged_decode(q, k16, v8[..., :dim].contiguous(), *args)
    # the kernel indexes both caches by the keys' blocks: fewer value blocks are refused
    with pytest.raises(ValueError, match="contiguous caches of the same blocks"):
        kernels.paged_decode(q, k16, v8[:-1].contiguous(), *args)


def to_pairs(k_rows: torch.Tensor) -> torch.Tensor:
    """A bfloat16 keys' cache [NB, KVH, BS, D] as pairs [NB, KVH, D / 2, BS, 2]."""
    NB, KVH, BS, D = k_rows.shape
    return k_rows.view(NB, KVH, BS, D // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


# Keys in pairs: blocks of 16 and 32 take 16 keys a vector where the CPU has AVX-512
# (windows start runs mid-block, partial blocks end them: masked lanes), blocks of 4 the
# per-key loop; 1 to 8 query heads a KV head keep accumulators in registers (four a head
# up to 4, two up to 8), 16 take the per-key loop; D 54 has an odd number of pairs. On
# AMX tiles (the builds that take them: tests/model/builds.py) D 64 and 128 with 1 to 8
# heads a KV head, 2 to 16 rows a tile.
@pytest.mark.parametrize("values", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "bs"),
    [
        (9, 3, 64, None, 16),
        (9, 3, 64, 37, 16),
        (4, 4, 128, None, 32),
        (16, 2, 128, None, 16),
        (8, 4, 128, 45, 64),
        (8, 1, 64, 21, 16),
        (16, 1, 32, None, 16),
        (6, 2, 54, 19, 32),
        (8, 2, 32, 5, 4),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_reads_bfloat16_keys_in_pairs(
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
    bs: int,
    values: torch.dtype,
    threads: int,
    kernels: NativeKernels,
) -> None:
    """Keys in pairs: the kernel equals the float32 path on the widened keys (scores of q as
    it is, in another order than the rows' sums; on AMX tiles of q as two bfloat16 halves,
    within ~1e-5), and so does the torch gather path, which puts the pairs back into rows.
    A build meant to score them on the tiles does."""
    assert kernels.decode_amx_scores == scores_on_tiles(kernels)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        q, k_cache, v_cache, tables, lens = _case(13, heads, kv_heads, dim, bs, seed=dim + bs)
        k16 = k_cache.bfloat16()
        v = quantize_rows(v_cache) if values == torch.int8 else v_cache.bfloat16()
        pairs = to_pairs(k16)
        assert native_mod.key_pairs(pairs) and not native_mod.key_pairs(k16)
        want = _torch_path(q, k16.float(), widen(v, torch.float32, dim), tables, lens, bs, window)
        got = torch.full_like(q, float("nan"))
        args = (tables.to(torch.int32), lens.to(torch.int32), got, dim**-0.5, window or 0)
        kernels.paged_decode(q, pairs, v, *args)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        gathered = _torch_path(q, pairs, v, tables, lens, bs, window)
        torch.testing.assert_close(gathered, want, atol=1e-6, rtol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_keys_in_pairs_are_refused_where_they_cannot_be_read(kernels: NativeKernels) -> None:
    """Pairs are bfloat16 keys of the values' blocks: any other dtype, a shape that is not
    the values' blocks in pairs, or the C prompt kernel over int8 values is refused, saying
    what it expected."""
    bs = 16
    q, k_cache, v_cache, tables, lens = _case(5, 9, 3, 64, bs, seed=3)
    pairs, v16 = to_pairs(k_cache.bfloat16()), v_cache.bfloat16()
    args = (tables.to(torch.int32), lens.to(torch.int32), torch.empty_like(q), 0.125, 0)
    with pytest.raises(TypeError, match=r"torch\.float32 keys in pairs over"):
        kernels.paged_decode(q, to_pairs(k_cache), v_cache, *args)
    with pytest.raises(ValueError, match=r"keys in pairs \(128, 3, 32, 16, 2\)"):
        kernels.paged_decode(q, pairs[:, :, :16].contiguous(), v16, *args)
    odd = torch.zeros(128, 3, 4, bs, 2, dtype=torch.bfloat16)  # 4 pairs: no head of 9
    with pytest.raises(ValueError, match="an even head size for keys in pairs"):
        kernels.paged_decode(
            q[..., :9].contiguous(),
            odd,
            v16[..., :9].contiguous(),
            *args[:2],
            q[..., :9].clone(),
            0.3,
            0,
        )
    with pytest.raises(ValueError, match="keys and values alike"):
        kernels.prefill_attention(
            q[:1].contiguous(),
            pairs,
            torch.zeros(*v16.shape[:3], 68, dtype=torch.int8),
            tables[0].to(torch.int32),
            3,
            q[:1].clone(),
            0.125,
        )


def test_keys_in_pairs_are_stored_by_torch_as_the_c_store_stores_them(
    kernels: NativeKernels,
) -> None:
    """store_kv (the torch path) and the C rotary op's store write a token's key into its
    slot of a pairs cache: both the rows' cache permuted, bit for bit."""
    heads, kv_heads, dim, bs, num_blocks, tokens = 6, 2, 64, 16, 8, 40
    g = torch.Generator().manual_seed(31)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos(), freqs.sin()
    rows = torch.zeros(num_blocks, kv_heads, bs, dim, dtype=torch.bfloat16)
    pairs = to_pairs(rows)
    v_rows, v_pairs = (
        torch.zeros(num_blocks, kv_heads, bs, dim + 4, dtype=torch.int8) for _ in "ab"
    )
    _, k, v = kernels.rope_store(qkv, cos, sin, slots, rows, v_rows, heads)
    kernels.rope_store(qkv, cos, sin, slots, pairs, v_pairs, heads)
    assert k is not None and v is not None
    assert torch.count_nonzero(rows) > 0
    assert torch.equal(pairs, to_pairs(rows)) and torch.equal(v_pairs, v_rows)
    meta = dataclasses.replace(
        _meta([], None, bs), slot_blocks=slots // bs, slot_offsets=slots % bs
    )
    by_torch = torch.zeros_like(pairs)
    store_kv(k, v, by_torch, torch.zeros_like(v_rows), meta)
    assert torch.equal(by_torch, pairs)


def test_paged_attention_runs_bfloat16_decode_rows_through_the_kernel(
    kernels: NativeKernels,
) -> None:
    bs = 4
    q, k_cache, v_cache, tables, lens = _case(5, 6, 2, 64, bs, seed=4)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    want = _torch_path(q.float(), k_cache.float(), v_cache.float(), tables, lens, bs, None)
    in_place = InPlaceDecode(kernels, tables.to(torch.int32), lens.to(torch.int32), 0)
    meta = _meta([], in_place, bs)
    no_kv = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    got = paged_attention(q, no_kv, no_kv, k_cache, v_cache, meta, 64**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)  # bf16 rounding of out


def test_paged_attention_runs_decode_rows_through_the_kernel(kernels: NativeKernels) -> None:
    bs = 4
    q, k_cache, v_cache, tables, lens = _case(5, 6, 2, 64, bs, seed=3)
    want = _torch_path(q, k_cache, v_cache, tables, lens, bs, None)
    in_place = InPlaceDecode(kernels, tables.to(torch.int32), lens.to(torch.int32), 0)
    meta = _meta([], in_place, bs)
    no_kv = torch.empty(0, 2, 64)
    got = paged_attention(q, no_kv, no_kv, k_cache, v_cache, meta, 64**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kernel_writes_bfloat16_rows_rounded_as_torch_rounds(
    cache_dtype: torch.dtype, kernels: NativeKernels
) -> None:
    """A bfloat16 output (the input of a bfloat16 output projection) holds the float32
    output rounded to nearest even, bit for bit, whatever the cache holds."""
    bs = 16
    q, k_cache, v_cache, tables, lens = _case(9, 9, 3, 64, bs, seed=21)
    if cache_dtype == torch.int8:
        k_cache, v_cache = _int8_caches(k_cache, v_cache)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    args = (tables.to(torch.int32), lens.to(torch.int32))
    wide = torch.full_like(q, float("nan"))
    kernels.paged_decode(q, k_cache, v_cache, *args, wide, 64**-0.5, 0)
    narrow = torch.full_like(q, float("nan"), dtype=torch.bfloat16)
    kernels.paged_decode(q, k_cache, v_cache, *args, narrow, 64**-0.5, 0)
    assert torch.equal(narrow, wide.bfloat16())
    with pytest.raises(TypeError, match="contiguous"):
        kernels.paged_decode(q, k_cache, v_cache, *args, wide.half(), 64**-0.5, 0)
    with pytest.raises(ValueError, match="an output of"):
        kernels.paged_decode(q, k_cache, v_cache, *args, wide[:4], 64**-0.5, 0)


def test_paged_attention_writes_into_the_output_projections_rows(kernels: NativeKernels) -> None:
    """With `out` (the output projection's input: its dtype, rows padded past T) the
    attention's rows land in its first T rows, rounded as a cast rounds; the padding rows
    are left as they were."""
    bs = 4
    q, k_cache, v_cache, tables, lens = _case(5, 6, 2, 64, bs, seed=8)
    in_place = InPlaceDecode(kernels, tables.to(torch.int32), lens.to(torch.int32), 0)
    meta = _meta([], in_place, bs)
    want = paged_attention(q, None, None, k_cache, v_cache, meta, 64**-0.5)  # [5, 6, 64]
    out = torch.full((8, 6, 64), 7.0, dtype=torch.bfloat16)
    got = paged_attention(q, None, None, k_cache, v_cache, meta, 64**-0.5, out=out)
    assert got is out
    assert torch.equal(out[:5], want.bfloat16())
    assert bool((out[5:] == 7.0).all())
    # the gather path (no kernel) writes the same rows through a cast
    gathered = torch.full((8, 6, 64), 7.0, dtype=torch.bfloat16)
    rows = (tables[:, None, :] * 2 + torch.arange(2)[None, :, None]).reshape(-1)
    group = DecodeGroup(0, 5, rows, tables.shape[1], decode_mask(lens, tables.shape[1] * bs, None))
    paged_attention(q, None, None, k_cache, v_cache, _meta([group], None, bs), 64**-0.5, gathered)
    torch.testing.assert_close(gathered[:5].float(), out[:5].float(), atol=1e-2, rtol=1e-2)
    assert bool((gathered[5:] == 7.0).all())


def test_no_compiler_is_a_reason_not_a_crash(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLOW_KERNEL_CACHE", str(tmp_path))
    loaded = load_native(compiler="no-such-compiler-kvflow")
    assert loaded.kernels is None
    assert "no C compiler" in loaded.reason and "no-such-compiler-kvflow" in loaded.reason


def test_a_failed_build_is_a_reason(tmp_path, monkeypatch) -> None:
    # `false` exists and fails like a compiler that cannot build the source.
    monkeypatch.setenv("KVFLOW_KERNEL_CACHE", str(tmp_path))
    loaded = load_native(compiler="false")
    assert loaded.kernels is None
    assert "did not build" in loaded.reason
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_native_attention_is_refused_on_cuda() -> None:
    with pytest.raises(ValueError, match="CPU kernel"):
        EngineConfig(device="cuda", attention="native")
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="fast")


def test_a_bfloat16_cache_holds_twice_the_blocks_and_says_why(tiny_model_dir) -> None:
    """A bf16 cache holds twice the blocks in the same memory; auto takes it behind bf16
    linear layers where the C kernel reads the cache in place, and on a CPU with AMX takes
    bf16 keys over int8 values. The start-up facts say which and why."""
    from worker.engine.model_runner import ModelRunner
    from worker.model.loader import load_model

    path = str(tiny_model_dir("smollm2"))
    runners = {
        kv: ModelRunner(
            # keys as rows (pairs: test_keys_in_pairs_take_the_same_blocks_and_say_why)
            EngineConfig(model=path, kv_cache_bytes=8 << 20, kv_cache_dtype=kv, key_layout="rows"),
            load_model(path, dtype="bfloat16"),
        )
        for kv in ("auto", "float32", "bfloat16", "int8", "bfloat16-int8")
    }
    auto, wide, narrow = runners["auto"], runners["float32"], runners["bfloat16"]
    # int8 rows: D values and their float32 scales (smollm2's tiny D is 16: one group of
    # 16 keys, so keys and values alike D + 4 bytes), in the same bytes
    i8, dim = runners["int8"], wide.kv_caches[0][0].shape[-1]
    assert i8.kv_dtype == torch.int8 and i8.info.kv_cache_dtype == "int8 (set explicitly)"
    assert all(k.shape[-1] == v.shape[-1] == dim + 4 for k, v in i8.kv_caches)
    rows_per_block = wide.info.kv_cache_bytes // wide.info.num_blocks // (4 * dim)  # K and V
    assert i8.info.num_blocks == (8 << 20) // (rows_per_block * (dim + 4))
    assert wide.kv_dtype == torch.float32 and narrow.kv_dtype == torch.bfloat16
    assert wide.info.kv_cache_dtype == "float32 (set explicitly)"
    assert narrow.info.kv_cache_dtype == "bfloat16 (set explicitly)"
    assert narrow.info.num_blocks == 2 * wide.info.num_blocks
    # bf16 keys (D) and int8 values (D + 4): a block's rows are half keys, half values
    mixed = runners["bfloat16-int8"]
    assert mixed.cache_dtypes == (torch.bfloat16, torch.int8)
    assert mixed.info.kv_cache_dtype == "bfloat16-int8 (set explicitly)"
    assert all(k.shape[-1] == dim and v.shape[-1] == dim + 4 for k, v in mixed.kv_caches)
    assert all(k.shape[:3] == v.shape[:3] for k, v in mixed.kv_caches)
    assert mixed.info.num_blocks == (8 << 20) // (rows_per_block // 2 * (3 * dim + 4))
    if auto.native is not None and "amx_bf16" in read_cpu_flags():
        assert auto.info.kv_cache_dtype.startswith("bfloat16-int8 (auto: bfloat16 linear")
        assert auto.cache_dtypes == (torch.bfloat16, torch.int8)
    elif auto.native is not None:
        assert auto.info.kv_cache_dtype.startswith("bfloat16 (auto: bfloat16 linear layers")
    else:
        assert auto.info.kv_cache_dtype.startswith("float32 (auto")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in narrow.kv_caches)


def test_keys_in_pairs_take_the_same_blocks_and_say_why(tiny_model_dir) -> None:
    """Keys in pairs are the rows' bytes in another order: the same blocks in the same
    memory. Auto takes them on a CPU with AVX-512 where the C kernel reads bfloat16 keys; the
    start-up facts say which and why; where pairs cannot be read, asking is refused."""
    from worker.engine.model_runner import ModelRunner
    from worker.model.loader import load_model

    path = str(tiny_model_dir("smollm2"))
    loaded = load_model(path, dtype="bfloat16")

    def runner(**kw: str) -> ModelRunner:
        return ModelRunner(EngineConfig(model=path, kv_cache_bytes=8 << 20, **kw), loaded)

    rows = runner(kv_cache_dtype="bfloat16-int8", key_layout="rows")
    if rows.native is None:  # no C compiler: nothing reads pairs
        with pytest.raises(ValueError, match="C decode kernel"):
            runner(kv_cache_dtype="bfloat16-int8", key_layout="pairs")
        return
    pairs = runner(kv_cache_dtype="bfloat16-int8", key_layout="pairs")
    assert rows.info.key_layout == "rows (set explicitly)"
    assert pairs.info.key_layout == "pairs (set explicitly)"
    assert pairs.info.num_blocks == rows.info.num_blocks
    for (kr, vr), (kp, vp) in zip(rows.kv_caches, pairs.kv_caches, strict=True):
        NB, KVH, BS, D = kr.shape
        assert kp.shape == (NB, KVH, D // 2, BS, 2) and kp.dtype == torch.bfloat16
        assert vp.shape == vr.shape
    auto = runner(kv_cache_dtype="bfloat16-int8")
    # pairs where AVX-512 scores them a vector at a time (int8 values never take the C
    # prompt kernel, which would read key rows)
    want = "pairs" if "avx512f" in read_cpu_flags() else "rows"
    assert auto.info.key_layout.startswith(f"{want} (auto")
    with pytest.raises(ValueError, match="keys in pairs are bfloat16"):
        runner(kv_cache_dtype="int8", key_layout="pairs")
    with pytest.raises(ValueError, match="C decode kernel"):
        runner(kv_cache_dtype="bfloat16", key_layout="pairs", attention="torch")


def test_older_instruction_sets_build_their_own_paths() -> None:
    """A build for an older -march than this CPU's is a library of its own that takes that
    instruction set's paths: no AVX-512 kernels (the row kernel, bfloat16 scores, the
    VNNI products) below it, no int16 products without AVX2."""
    native = load_build("native")
    assert native.march == "native"
    older = kernel_builds()[1:]
    assert older, "every CPU of this machine kind runs an older build than its own"
    for march in older:
        kernels = load_build(march)
        assert kernels.march == march and kernels.path != native.path
        assert not kernels.matmul_rows_built and not kernels.bf16_scores
        assert kernels.int16_lanes == (0 if march == "x86-64-v2" else 8)
    loaded = load_native(march="x86-64-v3")
    assert "built for x86-64-v3" in loaded.reason


def test_a_native_build_for_an_intel_core_says_so() -> None:
    """The decode kernel's vdpbf16ps scores are for AMD's cores: a native build on an Intel
    core (a Cooper Lake shows avx512_bf16 without AMX or FP16) defines KVFLOW_INTEL_CORE;
    builds for an older instruction set are no CPU's own and define nothing."""
    assert vendor_defines("native", INTEL) == ("-DKVFLOW_INTEL_CORE",)
    assert vendor_defines("native", "AuthenticAMD") == ()
    assert vendor_defines("native", "") == ()  # no vendor_id line: as before
    assert vendor_defines("x86-64-v4", INTEL) == ()


def test_a_march_this_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library built for a level the CPU lacks would load and then die of an illegal
    instruction at its first call: refused before the build, saying what is missing."""
    with pytest.raises(ValueError, match="march must be 'native' or one of"):
        load_native(march="znver9")
    avx2_only = MARCH_FLAGS["x86-64-v2"] | MARCH_FLAGS["x86-64-v3"]
    monkeypatch.setattr(native_mod, "read_cpu_flags", lambda: avx2_only - {"fma"})
    with pytest.raises(ValueError, match="does not run x86-64-v3 \\(it lacks fma\\)"):
        load_native(march="x86-64-v3")
    monkeypatch.setattr(native_mod, "read_cpu_flags", lambda: avx2_only)
    with pytest.raises(ValueError, match="does not run x86-64-v4 \\(it lacks avx512bw"):
        load_native(march="x86-64-v4")


def test_kernels_build_from_the_sources_they_are_given(tmp_path, monkeypatch) -> None:
    """`load_native(kernels=...)` builds the folder it is given (another version's sources,
    for ops/bench/kernel_ab.py): the library is named by the sources' bytes, so the same
    bytes elsewhere load the library already built, and changed ones build their own."""
    default = load_native()
    assert default.kernels is not None, default.reason
    same = tmp_path / "same"
    shutil.copytree(KERNELS, same)
    copied = load_native(kernels=same)
    assert copied.kernels is not None and copied.kernels.path == default.kernels.path
    changed = tmp_path / "changed"
    shutil.copytree(KERNELS, changed)
    source = changed / "paged_decode.c"
    text = source.read_text()
    assert "#define I8_KEY_GROUP 16 " in text
    source.write_text(text.replace("#define I8_KEY_GROUP 16 ", "#define I8_KEY_GROUP 8 "))
    monkeypatch.setenv("KVFLOW_KERNEL_CACHE", str(tmp_path / "cache"))  # a throwaway build
    # the check at load time sees the changed library's own constant (built for the
    # oldest level: a third of the native build's compile time)
    with pytest.raises(RuntimeError, match="groups int8 keys by 8 values"):
        load_native(march="x86-64-v2", kernels=changed)


def test_kernel_switches_come_from_the_environment(monkeypatch, tiny_model_dir) -> None:
    """KVFLOW_KERNEL_DEFINES flips the kernels' own switches for a whole engine (to time
    one, e.g. KVFLOW_AMX_SCORES=1): a build of its own, named in the start-up facts; any
    other flag is refused, saying which."""
    assert kernel_defines("") == ()
    assert kernel_defines("KVFLOW_AMX_SCORES=1, KVFLOW_X") == (
        "-DKVFLOW_AMX_SCORES=1",
        "-DKVFLOW_X",
    )
    for bad in ("AMX_SCORES=1", "KVFLOW_A=x", "KVFLOW_A;rm", "-O0"):
        with pytest.raises(ValueError, match="KVFLOW_KERNEL_DEFINES"):
            kernel_defines(bad)
    plain = load_native(defines=())
    monkeypatch.setenv("KVFLOW_KERNEL_DEFINES", "KVFLOW_AMX_SCORES=1")
    switched = load_native()
    assert switched.kernels is not None and plain.kernels is not None
    assert "with KVFLOW_AMX_SCORES=1" in switched.reason
    assert switched.kernels.path != plain.kernels.path
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("smollm2")), num_kv_blocks=64))
    assert "with KVFLOW_AMX_SCORES=1" in engine.info.attention
    monkeypatch.setenv("KVFLOW_KERNEL_DEFINES", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a kernel switch"):
        load_native()
