"""CPU kernels in C, compiled on first use for the machine they run on.

The paged decode attention kernel (kernels/paged_decode.c) reads each sequence's keys
and values straight out of the cache blocks; torch has no CPU op for that, and the
torch path (gather the blocks into a scratch tensor, then two matmuls) copies every
sequence's whole context once per layer and step. The layer's small per-token ops
(kernels/layer_ops.c: RMSNorm, rotary with the store of K/V into the cache, SiLU
and multiply) are one call each instead of a chain of torch ops. The kernels are plain
C with OpenMP, built with the system's C compiler (`-march=native`: the build is keyed
by the CPU's flags as well as the source) into a cache directory and loaded with
ctypes; where no compiler is found or the build fails, the caller keeps the torch path
and says why. The wrappers check every shape and dtype the C code relies on: a wrong
one is a TypeError or ValueError here, not a write out of bounds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.hardware import INTEL, read_cpu_flags, read_cpu_vendor

# The C kernels: `load_native` builds every .c file of the folder into one library, named
# by the bytes of those and of the .h files they include
KERNELS = Path(__file__).with_name("kernels")
CFLAGS = ("-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")  # and -march
# The older instruction sets `load_native` builds for, by the /proc/cpuinfo flags a CPU
# needs to run them (the x86-64 psABI levels, each adding to the one before; "native" is
# the CPU's own)
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
MARCH_FLAGS = {
    "x86-64-v2": _V2,
    "x86-64-v3": _V3,
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
LIBS = ("-lm",)  # libm with glibc's vector maths (the vectorised expf)
MAX_GROUP = 64  # query heads per KV head the kernel's per-pair arrays hold
KV_DTYPES = (torch.float32, torch.bfloat16)  # caches the kernel reads (q and out: float32)
# int8 caches hold rows of D values and then their float32 scales
# (worker.model.attention.quantize_rows): keys one scale per I8_KEY_GROUP values
# ([NB, KVH, BS, D + D / 4] bytes; one per row where D is not a multiple of it), values
# one per row ([.., D + 4]). Keys rounded per row cost next-token agreement, values do not
# (worker.hardware.choose_kv_dtype).
I8_SCALE_BYTES = 4
I8_KEY_GROUP = 16
# kernels/prefill_attention.c: the shapes its tiles hold (query heads per KV head, head
# dim a multiple of 8 up to 128, blocks that divide its chunks of 64 keys)
PREFILL_MAX_GROUP = 8
PREFILL_MAX_HEAD_DIM = 128
PREFILL_KEY_CHUNK = 64
# kernels/int16_matmul.c: weights rounded to 14 bits per output column, inputs to 13 bits
# per row and block of INT16_BLOCK inputs
INT16_WEIGHT_MAX = 8191
INT16_BLOCK = 64


@dataclass(frozen=True)
class Int16Weight:
    """A float32 linear layer's weight [N, K] rounded for kernels/int16_matmul.c:
    W ~= wq * scale[:, None], wq laid out [N / L, K / 2, L, 2] in column blocks of L lanes
    (`int16_layout`): 8 for the AVX2 build, 16 for the AVX-512 VNNI one."""

    wq: torch.Tensor  # [N / L, K / 2, L, 2] int16, |wq| <= INT16_WEIGHT_MAX
    scale: torch.Tensor  # [N] float32

    def __post_init__(self) -> None:
        # checked once here, so that each matmul checks only that its build reads it
        wq, scale = self.wq, self.scale
        if not (
            wq.dtype == torch.int16
            and wq.is_contiguous()
            and wq.dim() == 4
            and wq.shape[2] in (8, 16)
            and wq.shape[3] == 2
        ):
            raise ValueError(
                f"an int16 weight is [N / L, K / 2, L, 2] contiguous int16 with L 8 or 16, "
                f"not {wq.dtype} {tuple(wq.shape)}"
            )
        if not (
            scale.dtype == torch.float32
            and scale.is_contiguous()
            and scale.shape == (wq.shape[0] * wq.shape[2],)
        ):
            raise ValueError(
                f"an int16 weight of {wq.shape[0] * wq.shape[2]} columns needs as many "
                f"contiguous float32 scales, not {scale.dtype} {tuple(scale.shape)}"
            )

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    @property
    def in_features(self) -> int:
        return self.wq.shape[1] * 2

    @property
    def lanes(self) -> int:
        return self.wq.shape[2]

    @property
    def nbytes(self) -> int:
        return self.wq.numel() * 2 + self.scale.numel() * 4


@dataclass
class Scratch:
    """Grow-only bytes a kernel call works in and gives back when it returns (an int16
    matmul rounds its inputs there: 121 calls a step, each torch allocation ~3 us). One
    call at a time: a runner's steps are sequential, and each runner loads its own
    NativeKernels."""

    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    def take(self, nbytes: int) -> int:
        """The address of at least `nbytes` (64-byte aligned, as torch allocates)."""
        if self.data.numel() < nbytes:
            self.data = torch.empty(max(nbytes, 2 * self.data.numel()), dtype=torch.uint8)
        return int(self.data.data_ptr())


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library, one method per entry point."""

    lib: ctypes.CDLL
    path: Path
    march: str = "native"  # the instruction set it was built for (`load_native`)
    scratch: Scratch = field(default_factory=Scratch, compare=False, repr=False)

    @property
    def bf16_scores(self) -> bool:
        """Whether a bfloat16 cache's scores take q cut into two bfloat16 halves (vdpbf16ps
        on a CPU with avx512_bf16 that is not an Intel core (`vendor_defines`, or AMX or
        AVX-512 FP16 in its flags): within ~1e-5 of q as it is) rather than q as it is."""
        return bool(self.lib.kvflow_bf16_scores())

    @property
    def decode_amx_scores(self) -> bool:
        """Whether the decode kernel scores keys in pairs on AMX tiles (a build that takes
        them, KVFLOW_AMX_SCORES or the tiles emulated, and the tiles granted): q cut into
        two bfloat16 halves there too."""
        return bool(self.lib.kvflow_decode_amx_scores())

    def paged_decode_entry(
        self, k_dtype: torch.dtype, v_dtype: torch.dtype | None = None
    ) -> Callable[..., int]:
        """The library's decode attention for caches of these dtypes (keys', values'; by
        default the keys'): float32, bfloat16 or int8 alike, or bfloat16 keys over int8
        values, as `paged_decode` calls it."""
        entry: Callable[..., int] = getattr(self.lib, DECODE_ENTRIES[k_dtype, v_dtype or k_dtype])
        return entry

    def decode_entry(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[..., int]:
        """The decode attention for these caches: by their dtypes, and for bfloat16 keys in
        pairs (`key_pairs`) the pairs' entry."""
        if not key_pairs(k_cache):
            return self.paged_decode_entry(k_cache.dtype, v_cache.dtype)
        entry: Callable[..., int] = getattr(self.lib, PAIRS_ENTRIES[k_cache.dtype, v_cache.dtype])
        return entry

    def paged_decode(
        self,
        q: torch.Tensor,  # [n, H, D] float32, contiguous
        k_cache: torch.Tensor,  # [NB, KVH, BS, D] float32 or bfloat16, or int8 (cache_row);
        # or bfloat16 keys in pairs [NB, KVH, D / 2, BS, 2] (key_pairs)
        v_cache: torch.Tensor,  # like k_cache (rows), or int8 behind a bfloat16 k_cache
        block_tables: torch.Tensor,  # [n, max_blocks] int32
        context_lens: torch.Tensor,  # [n] int32
        out: torch.Tensor,  # [n, H, D] float32 or bfloat16, contiguous
        scale: float,
        window: int,
    ) -> None:
        """Attention of n query rows, each over its cached keys up to its own (a decode
        token, or a prompt chunk's row: see kernels/paged_decode.c), into `out` in its
        dtype (computed in float32; a bfloat16 `out` takes the results rounded)."""
        n, H, D = q.shape
        _check_cache(k_cache, v_cache, D, "reads")
        _, KVH, BS, _ = v_cache.shape
        _check_rows(q, float32_only=True)
        _check_rows(out)
        _expect(out.shape == q.shape, f"an output of {tuple(q.shape)}", out)
        failed = self.decode_entry(k_cache, v_cache)(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            out.dtype == torch.bfloat16,
            n,
            H,
            KVH,
            D,
            BS,
            block_tables.shape[1],
            ctypes.c_float(scale),
            window,
        )
        if failed == 2:
            raise ValueError(
                f"{H} query heads do not group over {KVH} KV heads (at most {MAX_GROUP} each)"
            )
        if failed == 4:
            raise ValueError(f"keys in pairs need an even head size, not {D}")
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch memory")

    def prefill_attention(
        self,
        q: torch.Tensor,  # [T, H, D] float32, contiguous: a prompt chunk's rows
        k_cache: torch.Tensor,  # [NB, KVH, BS, D] float32 or bfloat16, or bfloat16 pairs
        v_cache: torch.Tensor,  # [NB, KVH, BS, D], k_cache's dtype
        block_table: torch.Tensor,  # [>= cdiv(num_context + T, BS)] int32: the sequence's
        num_context: int,  # keys cached before the chunk
        out: torch.Tensor,  # [T, H, D] float32, contiguous
        scale: float,
    ) -> None:
        """Causal attention of a prompt chunk of one sequence over its context and itself,
        read in place from the cache (the chunk's K/V stored first), into `out`: keys in
        rows by kernels/prefill_attention.c (float32 products), keys in pairs by
        kernels/prefill_pairs.c (bfloat16 products, q and the softmax's weights rounded
        to bfloat16; CPUs with avx512_bf16: `prefill_pairs_built`)."""
        T, H, D = q.shape
        _check_cache(k_cache, v_cache, D, "reads")
        pairs = key_pairs(k_cache)
        KVH, BS = v_cache.shape[1], v_cache.shape[2]
        _check_rows(q, out, float32_only=True)
        _expect(out.shape == q.shape, f"an output of {tuple(q.shape)}", out)
        _expect(
            k_cache.dtype in KV_DTYPES and v_cache.dtype == k_cache.dtype,
            "a float32 or bfloat16 cache, keys and values alike",
            (k_cache.dtype, v_cache.dtype),
        )
        blocks = -(-(num_context + T) // BS)
        _expect(
            block_table.dtype == torch.int32
            and block_table.is_contiguous()
            and block_table.numel() >= blocks,
            f"an int32 block table of >= {blocks} blocks",
            block_table,
        )
        if pairs:
            entry = self.lib.kvflow_prefill_attention_bf16p
        elif k_cache.dtype == torch.float32:
            entry = self.lib.kvflow_prefill_attention_f32
        else:
            entry = self.lib.kvflow_prefill_attention_bf16
        failed = entry(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_table.data_ptr(),
            T,
            num_context,
            H,
            KVH,
            D,
            BS,
            out.data_ptr(),
            ctypes.c_float(scale),
        )
        if failed == 2:
            raise ValueError(
                f"the prompt attention kernel does not take {H} heads over {KVH} KV heads of "
                f"{D} in blocks of {BS}{' with keys in pairs' if pairs else ''} (see "
                "prefill_kernel_fits)"
            )
        if failed == 3:
            raise RuntimeError(
                "the prompt kernel over keys in pairs is not built for this CPU (it needs "
                "avx512_bf16: prefill_pairs_built)"
            )
        if failed:
            raise MemoryError("prompt attention could not allocate its scratch memory")

    @functools.cached_property
    def prefill_pairs_built(self) -> bool:
        """Whether the prompt kernel over keys in pairs (kernels/prefill_pairs.c) is built:
        where the library was built for a CPU with avx512_bf16."""
        return bool(self.lib.kvflow_prefill_pairs_built())

    def widen_top(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bfloat16 logits x [S, V] -> (their float32 values [S, V], the columns [S, width]
        int64 of each row's `width` largest, best first), in one pass over each row
        (kernels/logits.c)."""
        _check_logits(x)
        out = torch.empty(x.shape, dtype=torch.float32)
        return out, self._top(x, width, out)

    def top_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The columns [S, width] int64 of the `width` largest of each row of bfloat16
        logits x [S, V], best first (equal values: the lower column first), as `widen_top`
        picks them, without widening the rows."""
        return self._top(x, width, None)

    def _top(self, x: torch.Tensor, width: int, out: torch.Tensor | None) -> torch.Tensor:
        _check_logits(x)
        S, V = x.shape
        _expect(1 <= width <= min(V, WIDTH_MAX), f"a width of 1 .. {min(V, WIDTH_MAX)}", width)
        cols = torch.empty(S, width, dtype=torch.int64)
        into = None if out is None else out.data_ptr()
        if self.lib.kvflow_widen_top(x.data_ptr(), into, S, V, width, cols.data_ptr()):
            raise RuntimeError(f"the C library refused {width} candidates a row (its WIDTH_MAX)")
        return cols

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) of float32 rows x [S, V], contiguous: [S] int64
        (kernels/logits.c)."""
        _expect(
            x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda,
            "contiguous [S, V] float32 rows on the CPU",
            x,
        )
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.kvflow_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, C] float32, contiguous
        weight: torch.Tensor,  # [C] float32
        eps: float,
        residual: torch.Tensor | None = None,  # [>= T, C] float32 or bfloat16
        out_dtype: torch.dtype = torch.float32,
        rows: int | None = None,
    ) -> torch.Tensor:
        """RMSNorm of x's rows -> [rows (default T), C] in `out_dtype`, the rows past T
        zeroed; with `residual`, x += residual[:T] first, in place (the residual stream's
        add and the next norm in one pass)."""
        _check_rows(x, weight, float32_only=True)
        T, C = x.shape
        rows = T if rows is None else rows
        _expect(weight.shape == (C,), f"a norm weight of {C}", weight)
        _expect(rows >= T, f"at least {T} output rows", rows)
        out = torch.empty((rows, C), dtype=out_dtype)
        _check_rows(out)
        if residual is not None:
            _check_rows(residual)
            _expect(
                residual.shape[0] >= T and residual.shape[1:] == (C,), f"[>= {T}, {C}]", residual
            )
        self.lib.kvflow_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            T,
            rows,
            C,
            ctypes.c_float(eps),
            residual is not None and residual.dtype == torch.bfloat16,
            out_dtype == torch.bfloat16,
        )
        return out

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [R, 2 I] float32 or bfloat16: gate, then up
        out_dtype: torch.dtype = torch.float32,
        tokens: int | None = None,
    ) -> torch.Tensor:
        """[R, I] in `out_dtype`: silu(gate) * up for the first `tokens` rows (default all),
        the rest zeroed (the padding rows of a matmul's output)."""
        _check_rows(gate_up)
        R, two_i = gate_up.shape
        tokens = R if tokens is None else tokens
        _expect(two_i % 2 == 0 and 0 <= tokens <= R, f"[>= {tokens}, 2 I]", gate_up)
        out = torch.empty((R, two_i // 2), dtype=out_dtype)
        _check_rows(out)
        self.lib.kvflow_silu_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            tokens,
            R,
            two_i // 2,
            gate_up.dtype == torch.bfloat16,
            out_dtype == torch.bfloat16,
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,  # [>= T, (H + 2 KVH) * D] float32 or bfloat16, contiguous
        cos: torch.Tensor,  # [T, D/2] float32, contiguous
        sin: torch.Tensor,
        slots: torch.Tensor,  # [T] int64 cache slots, each < NB * BS (the caller's word)
        k_cache: torch.Tensor,  # [NB, KVH, BS, D] float32 or bfloat16, or int8 (cache_row);
        # or bfloat16 keys in pairs [NB, KVH, D / 2, BS, 2] (key_pairs)
        v_cache: torch.Tensor,  # like k_cache (rows), or int8 behind a bfloat16 k_cache
        num_heads: int,
        kv_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D], k and v [T, KVH, D], float32, each contiguous, from the first T rows
        of qkv, rotary applied to q and k; each token's k and v into its cache slot. Without
        `kv_out` k and v are only stored (None returned for them)."""
        _check_rows(qkv)
        _check_rows(cos, sin, float32_only=True)
        _expect(v_cache.dim() == 4, "a values' cache [NB, KVH, BS, row]", v_cache)
        _, KVH, BS, _ = v_cache.shape
        T, H = cos.shape[0], num_heads
        D = qkv.shape[1] // (H + 2 * KVH)  # the cache's rows: D values (int8: and scales)
        _expect(qkv.shape[0] >= T and qkv.shape[1] == (H + 2 * KVH) * D, "qkv rows", qkv)
        _check_cache(k_cache, v_cache, D, "writes")
        _expect(cos.shape == (T, D // 2) and sin.shape == cos.shape, f"[{T}, {D // 2}]", sin)
        _expect(slots.dtype == torch.int64 and slots.shape == (T,), f"{T} int64 slots", slots)
        out = torch.empty(T * (H + 2 * KVH if kv_out else H) * D, dtype=torch.float32)
        self.lib.kvflow_rope_store(
            qkv.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.contiguous().data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            T,
            H,
            KVH,
            D,
            BS,
            qkv.dtype == torch.bfloat16,
            *store_flags(k_cache.dtype, v_cache.dtype, D),
            kv_out,
            key_pairs(k_cache),
        )
        if not kv_out:
            return out.view(T, H, D), None, None
        q, k, v = torch.split(out, [T * H * D, T * KVH * D, T * KVH * D])
        return q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)

    @functools.cached_property
    def matmul_rows_built(self) -> bool:
        """Whether `matmul_rows` is built: where the library was built for a CPU with
        avx512_bf16."""
        return bool(self.lib.kvflow_matmul_rows_built())

    @functools.cached_property
    def matmul_rows_amx(self) -> bool:
        """Whether `matmul_rows` computes on AMX tiles (for inputs of a multiple of 32):
        where the library was built for a CPU with AMX and Linux granted this process the
        tiles (asked here, once)."""
        return bool(self.lib.kvflow_matmul_rows_amx())

    @functools.cached_property
    def int16_lanes(self) -> int:
        """The column blocks of the weight layout `linear_i16` reads (`int16_layout`): 16
        where the library was built for a CPU with AVX-512 VNNI, 8 for one with AVX2 and
        FMA, else 0 (the kernel is not there)."""
        return int(self.lib.kvflow_linear_i16_lanes())

    @property
    def int16_built(self) -> bool:
        """Whether `linear_i16` is built."""
        return self.int16_lanes > 0

    def linear_i16(
        self,
        x: torch.Tensor,  # [M, K] float32, contiguous
        weight: Int16Weight,
        bias: torch.Tensor | None = None,  # [N] float32
    ) -> torch.Tensor:
        """x @ W.T (+ bias) -> [M, N] float32 as 16-bit integer products
        (kernels/int16_matmul.c): x rounded per row and block of INT16_BLOCK inputs, W as
        `int16_layout` rounded it (in this build's column blocks, `int16_lanes`)."""
        _check_rows(x, float32_only=True)
        return self._linear_i16(self.lib.kvflow_linear_i16, x, x.shape[1], weight, bias)

    def linear_i16_silu(
        self,
        gate_up: torch.Tensor,  # [M, 2 K] float32, contiguous: gate, then up
        weight: Int16Weight,
        bias: torch.Tensor | None = None,  # [N] float32
    ) -> torch.Tensor:
        """`linear_i16` of silu(gate) * up (as `silu_mul` computes it), the product
        rounded a block at a time as it is computed: an MLP's down projection without its
        [M, K] input ever written out."""
        _check_rows(gate_up, float32_only=True)
        _expect(gate_up.shape[1] % 2 == 0, "[M, 2 K]", gate_up)
        K = gate_up.shape[1] // 2
        return self._linear_i16(self.lib.kvflow_linear_i16_silu, gate_up, K, weight, bias)

    def _linear_i16(
        self,
        fn: Callable[..., int],
        x: torch.Tensor,
        K: int,
        weight: Int16Weight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        M = x.shape[0]
        N, L = weight.out_features, self.int16_lanes
        if L == 0 or weight.in_features != K or weight.lanes != L:
            _expect(L > 0, "a library built with the int16 kernel (AVX2 and FMA)", L)
            _expect(weight.in_features == K, f"rows of {weight.in_features} inputs", x)
            _expect(False, f"an int16 layout [{N // L}, {K // 2}, {L}, 2]", weight.wq)
        if bias is not None:
            _check_rows(bias, float32_only=True)
            _expect(bias.shape == (N,), f"a bias of {N}", bias)
        xq_bytes, scratch_bytes = int16_scratch_bytes(M, K)
        xq = self.scratch.take(scratch_bytes)
        out = torch.empty((M, N), dtype=torch.float32)
        status = fn(
            x.data_ptr(),
            xq,
            xq + xq_bytes,
            weight.wq.data_ptr(),
            weight.scale.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            M,
            N,
            K,
        )
        if status:
            raise RuntimeError(f"the int16 matmul refused [{M}, {K}] x [{N}, {K}] ({status})")
        return out

    def matmul_rows(
        self,
        x: torch.Tensor,  # [R, K] bfloat16, contiguous; rows past `tokens` are padding
        weight: torch.Tensor,  # [N / 16, K / 2, 16, 2] bfloat16 (`rows_layout`)
        tokens: int,
    ) -> torch.Tensor:
        """x @ W.T for the first `tokens` rows of x -> [R, N] bfloat16, the padding rows
        zeroed (kernels/small_matmul.c): a linear layer of up to a few hundred rows, W laid
        out once by `rows_layout`."""
        R, K = x.shape
        blocks, pairs = weight.shape[0], weight.shape[1]
        _expect(x.dtype == torch.bfloat16 and x.is_contiguous(), "contiguous bfloat16 rows", x)
        _expect(
            weight.dtype == torch.bfloat16
            and weight.is_contiguous()
            and weight.shape[2:] == (16, 2)
            and 2 * pairs == K,
            f"a weight in rows layout [N / 16, {K // 2}, 16, 2] bfloat16",
            weight,
        )
        if not self.matmul_rows_built:
            raise ValueError("the row kernel is not built for this CPU (it needs avx512_bf16)")
        _expect(1 <= tokens <= R, f"1..{R} rows", tokens)
        out = torch.empty((R, 16 * blocks), dtype=torch.bfloat16)
        failed = self.lib.kvflow_matmul_rows_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), tokens, R, 16 * blocks, K
        )
        if failed:
            raise ValueError(f"the row kernel refused {tokens} rows of {K} (code {failed})")
        return out


def _check_logits(x: torch.Tensor) -> None:
    _expect(
        x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous() and not x.is_cuda,
        "contiguous [S, V] bfloat16 logits on the CPU",
        x,
    )


def int16_scratch_bytes(M: int, K: int) -> tuple[int, int]:
    """Where an int16 matmul of M rows of K inputs rounds them: xq [ceil(M / 4) * 4, K]
    int16 (four rows a group) at offset 0, then xs [M, ceil(K / INT16_BLOCK)] float32 at
    the first value returned (a multiple of 16 bytes); the second is the bytes in all."""
    xq_bytes = -(-M // 4) * 4 * K * 2
    return xq_bytes, xq_bytes + M * -(-K // INT16_BLOCK) * 4


def int16_layout(weight: torch.Tensor, lanes: int = 8) -> Int16Weight:
    """[N, K] float32 (N a multiple of `lanes`, K even) -> its Int16Weight in column blocks
    of `lanes` (`NativeKernels.int16_lanes`): each output column rounded to the nearest of
    2 * INT16_WEIGHT_MAX + 1 steps spanning its largest weight."""
    N, K = weight.shape
    if lanes not in (8, 16):
        raise ValueError(f"int16 weights are laid out in blocks of 8 or 16 columns, not {lanes}")
    if weight.dtype != torch.float32 or N % lanes != 0 or K % 2 != 0:
        raise ValueError(
            f"int16 weights need [N % {lanes} == 0, even K] float32, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    w = weight.detach()
    scale = (w.abs().amax(dim=1) / INT16_WEIGHT_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    wq = torch.round(w / scale[:, None]).to(torch.int16)  # [N, K]
    wq = wq.view(N // lanes, lanes, K // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Int16Weight(wq, scale.contiguous())


def rows_layout(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight [N, K] (N a multiple of 16, K even) -> [N / 16, K / 2, 16, 2]
    bfloat16, the layout `NativeKernels.matmul_rows` reads: each block of 16 output
    columns one contiguous run, pairs of inputs side by side as vdpbf16ps takes them."""
    N, K = weight.shape
    if N % 16 or K % 2:
        raise ValueError(f"rows layout needs N % 16 == 0 and K even, not {N} x {K}")
    w = weight.detach().to(torch.bfloat16)
    return w.view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def prefill_kernel_fits(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, pairs: bool = False
) -> bool:
    """Whether the prompt kernel's tiles hold these shapes: kernels/prefill_attention.c's
    for keys in rows, kernels/prefill_pairs.c's for keys in pairs (head dims a multiple of
    32, blocks of a multiple of 16 keys)."""
    group, left = divmod(num_heads, num_kv_heads)
    if left or group > PREFILL_MAX_GROUP or head_dim > PREFILL_MAX_HEAD_DIM:
        return False
    if pairs:
        return head_dim % 32 == 0 and block_size % 16 == 0
    return (
        head_dim % 8 == 0
        and block_size <= PREFILL_KEY_CHUNK
        and PREFILL_KEY_CHUNK % block_size == 0
    )


# The decode kernel's entry for each (keys', values') pair of cache dtypes: the pairs the C
# kernels read and write.
DECODE_ENTRIES = {
    (torch.float32, torch.float32): "kvflow_paged_decode_f32",
    (torch.bfloat16, torch.bfloat16): "kvflow_paged_decode_bf16",
    (torch.int8, torch.int8): "kvflow_paged_decode_i8",
    (torch.bfloat16, torch.int8): "kvflow_paged_decode_bf16_i8",
}
# The most candidates a row of logits gives `widen_top` (kernels/logits.c's WIDTH_MAX).
WIDTH_MAX = 64
# Likewise for bfloat16 keys stored in pairs within a block (`key_pairs`).
PAIRS_ENTRIES = {
    (torch.bfloat16, torch.bfloat16): "kvflow_paged_decode_bf16p",
    (torch.bfloat16, torch.int8): "kvflow_paged_decode_bf16p_i8",
}


def key_pairs(k_cache: torch.Tensor) -> bool:
    """Whether a keys' cache is stored in pairs: [NB, KVH, D / 2, BS, 2] bfloat16, a
    (block, head) run's dimensions 2p and 2p + 1 of its BS keys side by side, so that one
    vector holds 16 keys' values of two dimensions (the decode kernel's scores then take
    no sums across lanes: worker.hardware.choose_key_layout). Otherwise rows, [NB, KVH, BS,
    row]."""
    return k_cache.dim() == 5


def i8_group(D: int, keys: bool) -> int:
    """Values per float32 scale in an int8 cache's row of D values: I8_KEY_GROUP for keys
    (where D is a multiple of it), the whole row for values."""
    return I8_KEY_GROUP if keys and D % I8_KEY_GROUP == 0 else D


def cache_row(dtype: torch.dtype, D: int, keys: bool) -> int:
    """Elements of one cached row of D values (the keys' cache or the values'): D, or for
    int8 D bytes and their float32 scales (`worker.model.attention.quantize_rows`)."""
    if dtype != torch.int8:
        return D
    return D + I8_SCALE_BYTES * (D // i8_group(D, keys))


def store_flags(k_dtype: torch.dtype, v_dtype: torch.dtype, D: int) -> tuple[int, int, int]:
    """kvflow_rope_store's cache flags for a pair of cache dtypes: whether the cache that
    is not int8 is bfloat16 (keys and values alike there), and for the keys and for the
    values the values per int8 scale (0 where not int8)."""
    bf16 = torch.bfloat16 in (k_dtype, v_dtype)
    k_i8 = i8_group(D, keys=True) if k_dtype == torch.int8 else 0
    v_i8 = i8_group(D, keys=False) if v_dtype == torch.int8 else 0
    return int(bf16), k_i8, v_i8


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, D: int, verb: str) -> None:
    pairs = key_pairs(k_cache)
    if (k_cache.dtype, v_cache.dtype) not in (PAIRS_ENTRIES if pairs else DECODE_ENTRIES):
        raise TypeError(
            f"the C kernel {verb} a float32, bfloat16 or int8 cache (or bfloat16 keys over "
            f"int8 values; keys in pairs: bfloat16 over bfloat16 or int8 values), not "
            f"{k_cache.dtype} keys{' in pairs' if pairs else ''} over {v_cache.dtype} values"
        )
    for cache, keys in ((k_cache, True), (v_cache, False)):
        if not (keys and pairs):
            row = cache_row(cache.dtype, D, keys)
            _expect(cache.dim() == 4 and cache.shape[-1] == row, f"cache rows of {row}", cache)
    NB, KVH, BS, _ = v_cache.shape
    if pairs:
        _expect(D % 2 == 0, "an even head size for keys in pairs", D)
        want = (NB, KVH, D // 2, BS, 2)
        _expect(k_cache.shape == want, f"keys in pairs {want}", k_cache)
    # the kernels index both by the same blocks, heads and block size (pairs: checked
    # above), in place
    _expect(
        (pairs or k_cache.shape[:3] == v_cache.shape[:3])
        and k_cache.is_contiguous()
        and v_cache.is_contiguous(),
        f"contiguous caches of the same blocks {tuple(v_cache.shape[:3])}",
        k_cache,
    )


def _expect(ok: bool, what: str, got: object) -> None:
    if not ok:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else got
        raise ValueError(f"the C layer ops expected {what}, got {shape}")


def _check_rows(*tensors: torch.Tensor, float32_only: bool = False) -> None:
    """The layer ops read rows straight from memory: anything but contiguous float32 (or
    bfloat16 where allowed) is a bug."""
    allowed = (torch.float32,) if float32_only else KV_DTYPES
    for t in tensors:
        if t.dtype not in allowed or not t.is_contiguous():
            raise TypeError(
                f"the C layer ops take contiguous {allowed}, not {t.dtype} {t.stride()}"
            )


@dataclass(frozen=True)
class NativeLoad:
    """The kernels, or None and why not (for the start-up log)."""

    kernels: NativeKernels | None
    reason: str


def cache_dir() -> Path:
    root = os.environ.get("KVFLOW_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvflow", "kernels"
    )
    return Path(root)


def vendor_defines(march: str, vendor: str) -> tuple[str, ...]:
    """What the compiler's -march does not say of the CPU a native build is for: whether
    it is an Intel core, whose vdpbf16ps issues at half a float32 FMA's rate (the decode
    kernel then scores a bfloat16 cache with FMAs, as `worker.hardware.fast_bf16` leaves
    bfloat16 layers aside there). The build for an older instruction set is no CPU's own:
    none."""
    return ("-DKVFLOW_INTEL_CORE",) if march == "native" and vendor == INTEL else ()


_DEFINE = re.compile(r"KVFLOW_[A-Z0-9_]+(=-?[0-9]+)?")


def kernel_defines(text: str) -> tuple[str, ...]:
    """KVFLOW_KERNEL_DEFINES ("KVFLOW_AMX_SCORES=1", several split by spaces or commas) as
    the compiler's -D flags: the kernels' own switches only (KVFLOW_ names, integer
    values), for measurements."""
    out = []
    for item in text.replace(",", " ").split():
        if not _DEFINE.fullmatch(item):
            raise ValueError(
                f"KVFLOW_KERNEL_DEFINES: {item!r} is not a kernel switch NAME or NAME=integer "
                "with a KVFLOW_ name (e.g. KVFLOW_AMX_SCORES=1)"
            )
        out.append(f"-D{item}")
    return tuple(out)


def load_native(
    compiler: str | None = None,
    march: str = "native",
    kernels: Path = KERNELS,
    defines: tuple[str, ...] | None = None,
) -> NativeLoad:
    """Build (once per source, compiler, instruction set and CPU) and load the CPU kernels.

    `march` is the instruction set, as the compiler's -march names it: "native", this
    CPU's, is what the engine runs. An older one that this CPU also runs builds the code
    paths of CPUs without this one's extensions ("x86-64-v4": AVX-512 without bfloat16 or
    VNNI; "x86-64-v3": AVX2 and FMA, no AVX-512; "x86-64-v2": neither, the plain loops), so
    that tests and benchmarks on an AVX-512 machine check those paths too. A level this CPU
    does not run (its library would die at its first call) is a ValueError.

    `kernels` is the folder of the sources (another version's, for a benchmark that
    times two side by side in one process: `ops/bench/kernel_ab.py`). `defines` are the
    compiler's -D flags of a build variant the tests check (tests/model/builds.py: the
    AMX tiles emulated, KVFLOW_AMX_EMULATE; the score pass on them, KVFLOW_AMX_SCORES);
    None takes KVFLOW_KERNEL_DEFINES from the environment (`kernel_defines`), so that a
    whole engine can be timed with a switch of the kernels flipped."""
    if defines is None:
        defines = kernel_defines(os.environ.get("KVFLOW_KERNEL_DEFINES", ""))
    cpu = read_cpu_flags()
    if march != "native":
        if march not in MARCH_FLAGS:
            raise ValueError(
                f"march must be 'native' or one of {sorted(MARCH_FLAGS)}, not {march!r}"
            )
        missing = MARCH_FLAGS[march] - cpu
        if missing:
            raise ValueError(
                f"this CPU does not run {march} (it lacks {', '.join(sorted(missing))})"
            )
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return NativeLoad(None, f"no C compiler ({cc!r} not found)")
    flags = (*CFLAGS, f"-march={march}", *vendor_defines(march, read_cpu_vendor()), *defines)
    sources, headers = sorted(kernels.glob("*.c")), sorted(kernels.glob("*.h"))
    key = hashlib.sha256(
        b"\0".join(
            [
                *(path.name.encode() + path.read_bytes() for path in sources + headers),
                " ".join(flags + LIBS).encode(),
                cc.encode(),
                " ".join(sorted(cpu)).encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"kvflow-{key}.so"
    if not target.exists():
        try:
            _build(cc, flags, sources, target)
        except (OSError, subprocess.SubprocessError) as e:
            return NativeLoad(None, f"the C kernels did not build ({e})")
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        target.unlink(missing_ok=True)  # rebuilt next time rather than failing for ever
        return NativeLoad(None, f"the C kernels did not load ({e})")
    for fn in (getattr(lib, name) for name in (*DECODE_ENTRIES.values(), *PAIRS_ENTRIES.values())):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
    for fn in (
        lib.kvflow_prefill_attention_f32,
        lib.kvflow_prefill_attention_bf16,
        lib.kvflow_prefill_attention_bf16p,
    ):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_float]
    lib.kvflow_prefill_pairs_built.restype = ctypes.c_int
    lib.kvflow_prefill_pairs_built.argtypes = []
    lib.kvflow_bf16_scores.restype = ctypes.c_int
    lib.kvflow_bf16_scores.argtypes = []
    lib.kvflow_decode_amx_scores.restype = ctypes.c_int
    lib.kvflow_decode_amx_scores.argtypes = []
    lib.kvflow_rms_norm.restype = None
    lib.kvflow_rms_norm.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_int] * 2
    )
    lib.kvflow_widen_top.restype = ctypes.c_int
    lib.kvflow_widen_top.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.kvflow_argmax_rows.restype = None
    lib.kvflow_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.kvflow_silu_mul.restype = None
    lib.kvflow_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5
    lib.kvflow_rope_store.restype = None
    lib.kvflow_rope_store.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 11
    lib.kvflow_matmul_rows_bf16.restype = ctypes.c_int
    lib.kvflow_matmul_rows_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    lib.kvflow_matmul_rows_built.restype = ctypes.c_int
    lib.kvflow_matmul_rows_built.argtypes = []
    lib.kvflow_matmul_rows_amx.restype = ctypes.c_int
    lib.kvflow_matmul_rows_amx.argtypes = []
    for i16 in (lib.kvflow_linear_i16, lib.kvflow_linear_i16_silu):
        i16.restype = ctypes.c_int
        i16.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 3
    lib.kvflow_layer_stack.restype = ctypes.c_int
    lib.kvflow_layer_stack.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 3
    lib.kvflow_layer_stack_sizes.restype = None
    lib.kvflow_layer_stack_sizes.argtypes = [ctypes.c_void_p]
    lib.kvflow_linear_i16_lanes.restype = ctypes.c_int
    lib.kvflow_linear_i16_lanes.argtypes = []
    lib.kvflow_i8_key_group.restype = ctypes.c_int
    lib.kvflow_i8_key_group.argtypes = []
    # the store takes the key group from store_flags; the decode kernel has its own built in
    if lib.kvflow_i8_key_group() != I8_KEY_GROUP:
        raise RuntimeError(
            f"{target.name} groups int8 keys by {lib.kvflow_i8_key_group()} values, "
            f"this module by {I8_KEY_GROUP}"
        )
    built_for = "this CPU" if march == "native" else march
    if defines:
        built_for += f" with {' '.join(d.removeprefix('-D') for d in defines)}"
    return NativeLoad(
        NativeKernels(lib, target, march), f"C kernels built for {built_for} ({target.name})"
    )


def _build(cc: str, flags: tuple[str, ...], sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent builders never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", tmp, *map(str, sources), *LIBS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise subprocess.SubprocessError(proc.stderr.strip().splitlines()[-1:] or "failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
