"""The C layer ops (RMSNorm, rotary + K/V store, SiLU and multiply) equal the torch ops
they replace, on the calling thread and on the OpenMP path (32 tokens and more)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.model.attention import quantize_rows, widen
from worker.model.llama import RMSNorm, Rotary
from worker.model.loader import load_model
from worker.model.native import NativeKernels


@pytest.fixture
def ops(kernels: NativeKernels) -> NativeKernels:
    """The ops in each build this CPU runs (tests/model/conftest.py)."""
    return kernels


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
    gate_up = torch.randn(tokens + 6, 2 * 96, generator=g) * 4
    # gates far out on both sides (exp(-gate) overflows float32 below about -88.7)
    gate_up[0, :8] = torch.tensor([-1e4, -1000.0, -100.0, -89.0, 89.0, 100.0, 1000.0, 1e4])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up[:tokens].float().split(96, dim=-1)
    out = ops.silu_mul(gate_up, dtype, tokens)
    assert out.dtype == dtype and out.shape == (tokens + 6, 96)
    tol = {"rtol": 2**-8, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    want = (F.silu(gate) * up).to(dtype).float()
    torch.testing.assert_close(out[:tokens].float(), want, **tol)
    assert torch.count_nonzero(out[tokens:]) == 0  # padding rows zeroed, not computed


def test_rms_norm_with_a_bfloat16_residual_into_padded_bfloat16_rows(ops: NativeKernels) -> None:
    """What a decoder layer asks of it: x += o_proj's padded bfloat16 output, then the
    norm into the next matmul's padded bfloat16 input."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 64, generator=g)
    delta = torch.randn(16, 64, generator=g).bfloat16()
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    expected_x = x + delta[:13].float()
    out = ops.rms_norm(x, norm.weight, 1e-6, delta, torch.bfloat16, rows=16)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)
    torch.testing.assert_close(out[:13].float(), norm(expected_x), rtol=2**-8, atol=1e-6)
    assert torch.count_nonzero(out[13:]) == 0


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

    q_out, k_out, v_out = ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads)

    assert q_out.shape == (tokens, heads, dim) and k_out.shape == (tokens, kv_heads, dim)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (q_out, k_out, v_out))
    assert torch.equal(qkv, before)  # its input is left as it was
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_out, v_ref)  # widened exactly
    # The cache holds the kernel's own rotated k and v, rounded as torch rounds to the
    # cache's dtype: bit for bit, ties included.
    stored_k = k_cache[slots // bs, :, slots % bs]  # [T, KVH, D]
    stored_v = v_cache[slots // bs, :, slots % bs]
    assert torch.equal(stored_k, k_out.to(cache_dtype))
    assert torch.equal(stored_v, v_ref.to(cache_dtype))
    # nothing written outside the tokens' slots
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    for cache in (k_cache, v_cache):
        untouched = cache.permute(0, 2, 1, 3).reshape(num_blocks * bs, -1)[~written]
        assert torch.count_nonzero(untouched) == 0


@pytest.mark.parametrize("tokens", [5, 300])
def test_rope_store_without_k_and_v_out_stores_the_same(ops: NativeKernels, tokens: int) -> None:
    """Where no prompt chunk attends to its own K/V (every row through the kernel), the
    op returns q alone and stores into the cache exactly what it stores with k and v out."""
    heads, kv_heads, dim, bs, num_blocks = 9, 3, 64, 16, 64
    g = torch.Generator().manual_seed(tokens + 1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    angles = torch.rand(tokens, dim // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    caches = []
    outs = []
    for kv_out in (True, False):
        k_cache = torch.zeros(num_blocks, kv_heads, bs, dim, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        outs.append(ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_out))
        caches.append((k_cache, v_cache))
    (q_all, k_all, v_all), (q, k, v) = outs
    assert k is None and v is None and k_all is not None and v_all is not None
    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    assert torch.equal(q, q_all)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.count_nonzero(caches[1][0]) > 0


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_quantizes_k_and_v_into_an_int8_cache(
    ops: NativeKernels, qkv_dtype: torch.dtype
) -> None:
    """An int8 cache takes each token's K and V rows as `quantize_rows` makes them from the
    kernel's own float32 k and v (keys a scale per 16 values, values one per row): the
    same int8 values and float32 scales, byte for byte; an all-zero row gets scale 0;
    nothing outside the tokens' slots is written."""
    heads, kv_heads, dim, bs, num_blocks, tokens = 6, 2, 64, 16, 32, 40
    g = torch.Generator().manual_seed(17)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3
    qkv[3, (heads + kv_heads) * dim : (heads + kv_heads + 1) * dim] = 0  # one V row all zero
    # one K row's groups 0 and 2 all zero: rotation pairs value i with i + 32, so inputs
    # 0-15 and 32-47 zero leave outputs 0-15 and 32-47 zero
    qkv[5, heads * dim : heads * dim + 16] = 0
    qkv[5, heads * dim + 32 : heads * dim + 48] = 0
    qkv = qkv.to(qkv_dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos(), freqs.sin()
    k_cache = torch.zeros(num_blocks, kv_heads, bs, dim + dim // 4, dtype=torch.int8)
    v_cache = torch.zeros(num_blocks, kv_heads, bs, dim + 4, dtype=torch.int8)

    _, k_out, v_out = ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads)

    stored_k = k_cache[slots // bs, :, slots % bs]  # [T, KVH, D + D / 4]
    stored_v = v_cache[slots // bs, :, slots % bs]  # [T, KVH, D + 4]
    assert torch.equal(stored_k, quantize_rows(k_out, 16))
    assert torch.equal(stored_v, quantize_rows(v_out))
    assert torch.equal(stored_v[3, 0], torch.zeros(dim + 4, dtype=torch.int8))
    k_scales = stored_k[5, 0, dim:].view(torch.float32)  # [4], one a group
    assert k_scales[0] == k_scales[2] == 0 and bool((k_scales[[1, 3]] > 0).all())
    assert not stored_k[5, 0, :16].any() and not stored_k[5, 0, 32:48].any()
    # dequantized, each value is within half a step (its group's max / 254) of k
    err = (widen(stored_k, torch.float32, dim) - k_out).unflatten(-1, (dim // 16, 16)).abs()
    amax = k_out.unflatten(-1, (dim // 16, 16)).abs().amax(-1, keepdim=True)
    assert bool((err <= amax / 254 * 1.0001).all())
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    for cache in (k_cache, v_cache):
        untouched = cache.permute(0, 2, 1, 3).reshape(num_blocks * bs, -1)[~written]
        assert torch.count_nonzero(untouched) == 0
    with pytest.raises(ValueError, match="cache rows of 80"):
        narrow = torch.zeros(num_blocks, kv_heads, bs, dim, dtype=torch.int8)
        ops.rope_store(qkv, cos, sin, slots, narrow, narrow.clone(), heads)
    with pytest.raises(ValueError, match="cache rows of 80"):  # keys in rows of one scale
        ops.rope_store(qkv, cos, sin, slots, v_cache, v_cache.clone(), heads)
    with pytest.raises(ValueError, match="cache rows of 68"):  # values in the keys' groups
        ops.rope_store(qkv, cos, sin, slots, k_cache, k_cache.clone(), heads)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_keeps_keys_in_bfloat16_and_quantizes_values(
    ops: NativeKernels, qkv_dtype: torch.dtype
) -> None:
    """Bfloat16 keys over int8 values: each token's K row rounded to bfloat16 as torch
    rounds, its V row as `quantize_rows` makes it, byte for byte; nothing else written."""
    heads, kv_heads, dim, bs, num_blocks, tokens = 6, 2, 64, 16, 32, 40
    g = torch.Generator().manual_seed(23)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(qkv_dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    freqs = torch.outer(positions.float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = freqs.cos(), freqs.sin()
    k_cache = torch.zeros(num_blocks, kv_heads, bs, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros(num_blocks, kv_heads, bs, dim + 4, dtype=torch.int8)

    _, k_out, v_out = ops.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads)

    assert torch.equal(k_cache[slots // bs, :, slots % bs], k_out.bfloat16())
    assert torch.equal(v_cache[slots // bs, :, slots % bs], quantize_rows(v_out))
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    for cache in (k_cache, v_cache):
        untouched = cache.permute(0, 2, 1, 3).reshape(num_blocks * bs, -1)[~written]
        assert torch.count_nonzero(untouched) == 0
    with pytest.raises(TypeError, match=r"int8 keys over torch\.bfloat16 values"):
        ops.rope_store(qkv, cos, sin, slots, v_cache, k_cache, heads)


def test_layer_ops_refuse_what_they_cannot_read(ops: NativeKernels) -> None:
    x = torch.randn(8, 64)
    w = torch.ones(64)
    with pytest.raises(TypeError, match="contiguous"):
        ops.rms_norm(x.t().contiguous().t(), w, 1e-6)
    with pytest.raises(TypeError, match="float16"):
        ops.silu_mul(torch.randn(8, 64).half())
    with pytest.raises(ValueError, match="at least 8 output rows"):
        ops.rms_norm(x, w, 1e-6, rows=2)
    with pytest.raises(ValueError, match="norm weight"):
        ops.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="8, 64"):
        ops.rms_norm(x, w, 1e-6, residual=torch.randn(4, 64))
    with pytest.raises(ValueError):
        ops.silu_mul(torch.randn(8, 64), tokens=9)
    k_cache = torch.zeros(4, 2, 16, 64)
    cos = torch.randn(8, 32)
    qkv = torch.randn(8, (6 + 4) * 64)
    slots = torch.arange(8)
    with pytest.raises(ValueError, match="int64 slots"):
        ops.rope_store(qkv, cos, cos, slots.int(), k_cache, k_cache.clone(), 6)
    with pytest.raises(ValueError, match="qkv rows"):
        ops.rope_store(qkv[:4], cos, cos, slots, k_cache, k_cache.clone(), 6)
    with pytest.raises(ValueError, match="qkv rows"):
        ops.rope_store(qkv, cos, cos, slots, k_cache, k_cache.clone(), 5)


@pytest.mark.parametrize("variant", ["llama3", "smollm2", "mistral", "qwen2"])
@pytest.mark.parametrize(
    ("dtype", "kv", "keys"),
    [
        ("float32", "float32", "auto"),
        ("bfloat16", "bfloat16", "auto"),
        ("float32", "int8", "auto"),
        ("bfloat16", "int8", "auto"),
        ("bfloat16", "bfloat16-int8", "auto"),
        # bfloat16 keys in pairs, stored by the C op or by torch, the continued chunk's
        # context gathered back into rows for SDPA
        ("bfloat16", "bfloat16", "pairs"),
        ("bfloat16", "bfloat16-int8", "pairs"),
    ],
)
def test_layer_ops_path_equals_the_torch_path(
    variant: str, dtype: str, kv: str, keys: str, tiny_model_dir
) -> None:
    """The same steps (a prefill; then decode rows, a fresh prefill and a chunk continuing
    a cached prompt, mixed) through the C layer ops and through the torch ops, both with
    the C attention kernel: logits and caches agree (bfloat16 layers: padded rows; an int8
    cache, or int8 values behind bfloat16 keys: the C store's rows and torch's
    `quantize_rows`, compared dequantized)."""
    from tests.model.test_equivalence import _sched

    path = tiny_model_dir(variant)
    logits, caches = [], []
    for with_ops in (True, False):
        cfg = EngineConfig(
            model=str(path),
            block_size=4,
            num_kv_blocks=64,
            attention="native",
            dtype=dtype,
            kv_cache_dtype=kv,
            key_layout=keys,
            # SDPA for prompts (the C prompt kernel reads key rows only)
            **({"prefill_attention": "float32"} if keys == "pairs" else {}),
        )
        runner = ModelRunner(cfg, load_model(str(path), dtype=dtype))
        assert keys != "pairs" or runner.kv_caches[0][0].dim() == 5
        assert runner.layer_ops is not None
        assert all(layer.takes_layer_ops for layer in runner.model.layers)
        if not with_ops:
            runner.layer_ops = None
        g = torch.Generator().manual_seed(7)
        a = torch.randint(0, 1000, (30,), generator=g).tolist()
        b = torch.randint(0, 1000, (26,), generator=g).tolist()
        blocks_a, blocks_b = list(range(8)), list(range(8, 15))
        out = [runner.all_logits([_sched("a", a, 0, 23, blocks_a)])["a"]]
        step = runner.all_logits([_sched("a", a, 23, 1, blocks_a), _sched("b", b, 0, 11, blocks_b)])
        out += [step["a"], step["b"]]
        step = runner.all_logits(
            [_sched("b", b, 11, 15, blocks_b), _sched("a", a, 24, 1, blocks_a)]
        )
        out += [step["a"], step["b"]]
        logits.append(out)
        dim = runner.model.config.head_dim
        caches.append(
            [widen(c[:15], torch.float32, dim) for pair in runner.kv_caches for c in pair]
        )
    exact = dtype == "float32" and kv == "float32"
    tol = {"atol": 1e-4, "rtol": 1e-4} if exact else {"atol": 2e-2, "rtol": 1e-2}
    for got, want in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(*caches, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_int8_and_qk_norm_layers_keep_the_torch_ops(tiny_model_dir) -> None:
    qwen3 = load_model(str(tiny_model_dir("qwen3")))
    assert not any(layer.takes_layer_ops for layer in qwen3.model.layers)
    int8 = load_model(str(tiny_model_dir("llama3")), dtype="int8")
    assert not any(layer.takes_layer_ops for layer in int8.model.layers)
    plain = load_model(str(tiny_model_dir("llama3")))
    assert all(layer.takes_layer_ops for layer in plain.model.layers)


@pytest.mark.parametrize(
    ("rows", "vocab", "width"), [(64, 49152, 16), (3, 1000, 16), (5, 37, 7), (2, 70, 64)]
)
def test_widen_top_widens_and_picks_each_rows_best(
    ops: NativeKernels, rows: int, vocab: int, width: int
) -> None:
    """One pass over bfloat16 logits: their float32 values exactly, and the columns of each
    row's `width` best, best first, the lower column first among equal values (a vocabulary
    that is no multiple of the 32-value blocks included; bfloat16 values tie often)."""
    g = torch.Generator().manual_seed(vocab + width)
    x = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    x[0, -1] = 40.0  # the best in the last (short) block
    wide, cols = ops.widen_top(x, width)
    assert wide.dtype == torch.float32 and torch.equal(wide, x.float())
    assert cols.shape == (rows, width) and cols.dtype == torch.int64
    assert cols[0, 0] == vocab - 1
    picked = wide.gather(1, cols)
    assert torch.equal(picked, wide.topk(width, -1).values)  # the best values, in order
    # best first, equal values in column order: a stable descending sort's first `width`
    assert torch.equal(cols, wide.sort(dim=-1, descending=True, stable=True).indices[:, :width])
    # the columns alone, without the widened rows: the same picks
    assert torch.equal(ops.top_columns(x, width), cols)
    with pytest.raises(ValueError, match="a width of 1"):
        ops.widen_top(x, 0)
    with pytest.raises(ValueError, match="bfloat16 logits"):
        ops.widen_top(x.float(), width)
    with pytest.raises(ValueError, match="a width of 1"):
        ops.top_columns(x, vocab + 1)


def test_greedy_picks_from_the_c_candidates_are_the_argmax(ops: NativeKernels) -> None:
    """top_columns' candidates of bfloat16 rows full of ties, scored again with small
    errors (some down to the floor, some under it), then greedy_pick: torch's argmax of
    the widened rows with the scores written over the candidates, row by row, the rows
    that must be widened whole included."""
    from worker.model.candidates import greedy_pick

    g = torch.Generator().manual_seed(44)
    for vocab, width in ((300, 16), (5000, 16), (40, 16), (12, 16)):
        narrow = (torch.randn(64, vocab, generator=g) * 4).round().bfloat16()  # many ties
        cols = ops.top_columns(narrow, min(width, vocab))
        exact = narrow.float().gather(1, cols)
        exact += torch.randint(-2, 2, exact.shape, generator=g) * 0.5
        got = greedy_pick(narrow, cols, exact)
        want = narrow.float().scatter(1, cols, exact).argmax(-1)
        assert torch.equal(got, want), vocab


def test_argmax_rows_is_torch_argmax(ops: NativeKernels) -> None:
    """The first column of each row's largest value, ties (bfloat16 values) and rows of
    -inf with one finite value included, as torch.argmax gives it."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 49152, generator=g).bfloat16().float()
    x[1, 7] = x[1, 30000] = 60.0  # a tie for the best: the first
    x[2] = -torch.inf
    x[2, 49151] = -1e30
    x[3] = -torch.inf  # nothing but -inf: the first column, as torch gives it
    small = torch.randn(4, 70, generator=g)
    for t in (x, small):
        assert torch.equal(ops.argmax_rows(t), t.argmax(-1))
    with pytest.raises(ValueError, match="float32 rows"):
        ops.argmax_rows(x.t())


def test_the_sampler_picks_the_same_tokens_through_the_c_argmax(ops: NativeKernels) -> None:
    """Greedy rows (alone, and beside others, penalized), and seeded random rows (whose
    race ends in an argmax): the same tokens with the C argmax as with torch's."""
    from worker.model.sampler import Sampler, SamplingRow
    from worker.request import SamplingParams

    g = torch.Generator().manual_seed(12)
    logits = torch.randn(6, 5000, generator=g) * 4
    logits[0, 10] = logits[0, 4000] = logits[4, 7] = logits[4, 9] = 30.0  # ties for the best
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SamplingRow(greedy, 0, (), (), ()),
        SamplingRow(dataclasses.replace(greedy, repetition_penalty=1.3), 2, (5, 9), (7,), ()),
        SamplingRow(SamplingParams(temperature=0.8, seed=3), 0, (), (), ()),
        SamplingRow(SamplingParams(temperature=1.2, seed=4), 5, (), (), ()),
        SamplingRow(greedy, 1, (), (), ()),
        SamplingRow(SamplingParams(temperature=1.0), 0, (), (), ()),  # inverse CDF, no argmax
    ]
    calls = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return ops.argmax_rows(x)

    for ids in ([0, 1, 2, 3, 4, 5], [0, 4], [2, 3]):
        chosen, x = [rows[i] for i in ids], logits[ids]
        torch_picks = Sampler(seed=1)(x.clone(), chosen).token_ids
        c_picks = Sampler(seed=1, row_argmax=counted)(x.clone(), chosen).token_ids
        assert c_picks == torch_picks
    # the C argmax did the picking: the 3 greedy rows, then the 2 seeded ones' race (the
    # unseeded row beside them draws by inverse CDF); then each set alone
    assert calls == [3, 2, 2, 2]


@pytest.mark.parametrize("tokens", [3, 300])
def test_silu_mul_rounds_to_bfloat16_as_torch_rounds(ops: NativeKernels, tokens: int) -> None:
    """SiLU and multiply into bfloat16 rows is its float32 result rounded as torch rounds,
    bit for bit: a row of 700 values (chunks of 512 and a remainder, runs of 16 and a
    tail), products that are denormal in float32, zeros, large values."""
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 700, generator=g) * 4).bfloat16()
    gate_up[0, :4] = 1.0
    gate_up[0, 700:704] = torch.tensor([1e-39, -3e-39, 0.0, 1e30]).bfloat16()
    wide = ops.silu_mul(gate_up, torch.float32, tokens)
    narrow = ops.silu_mul(gate_up, torch.bfloat16, tokens)
    assert torch.equal(narrow.view(torch.int16), wide.bfloat16().view(torch.int16))
