"""Paged attention over a block KV cache, for a flattened mixed batch.

The batch is a flat run of T tokens: first the decode tokens (one per running
sequence, grouped by context length), then prefill chunks (one contiguous run per
sequence). Every layer writes its new K/V into the cache through `slot_mapping`, then:

- decode tokens, on CPU, go to the C kernel (worker.model.native) that reads each
  sequence's blocks in place: one call per layer for all of them, no copy of the context;
- elsewhere (CUDA, or no C compiler), decode groups gather the blocks of their sequences
  into a padded scratch tensor and attend with two batched matmuls, the G = heads //
  kv_heads query heads of a KV head taken as G queries against that head (no K/V
  repetition for GQA);
- a prefill chunk of a fresh prompt attends to its own K/V (causal, SDPA), no gather;
- a chunk that continues a cached prefix (chunked prefill, prefix-cache hit) gathers
  its sequence's blocks and uses a causal mask shifted by the cached length;
- with prefill attention "native" (CPU), prompt chunks skip both: each of their rows
  joins the kernel's call as a query over the keys up to its own position.

The cache is head-major, [num_blocks, KVH, block_size, D]: a block holds KVH runs of
block_size keys, one per KV head, so gathering rows (block * KVH + head) in the order
(sequence, head, block) lays out each sequence's keys as [KVH, L, D], contiguous, the
shape the batched matmuls read without another copy. (With token-major blocks the same
gather needs a transpose, and SDPA's CPU kernel for a few queries per head was ~1.3x
slower than bmm + float32 softmax at 64 sequences of 272 tokens.) Bfloat16 keys may be
stored in pairs instead, [num_blocks, KVH, D / 2, block_size, 2] (`native.key_pairs`,
for the C kernel): a gather puts a run's pairs back into rows.

Everything a layer needs is in `AttentionMetadata`, built once per step by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.model.native import I8_SCALE_BYTES, NativeKernels, i8_group, key_pairs


class Workspace:
    """Grow-only scratch buffers, reused by every layer and every step.

    On CPU a fresh multi-megabyte tensor is mmap'ed and page-faulted on first touch,
    which costs more than the gather that fills it; reusing one buffer avoids that.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] view of the named buffer in `dtype` (contents undefined)."""
        numel = rows * cols
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            # Grow by half again so a slowly rising need does not reallocate every step.
            grown = int(buf.numel() * 1.5) if buf is not None and buf.dtype == dtype else 0
            buf = torch.empty(max(numel, grown), device=self.device, dtype=dtype)
            self._buffers[name] = buf
        return buf[:numel].view(rows, cols)


@dataclass
class DecodeGroup:
    """Decode tokens [start, end) attended together over padded contexts."""

    start: int
    end: int
    # [n * KVH * nb] rows block * KVH + head, ordered (sequence, head, block); padding
    # repeats a valid block
    gather_index: torch.Tensor
    num_blocks: int  # nb
    mask: torch.Tensor  # [n, 1, 1, nb * block_size] bool, True where the key is visible


@dataclass
class InPlaceDecode:
    """Rows [0, n) attended by the C kernel straight from the cache blocks: decode tokens
    and, where prefill attention is "native", prompt chunks' rows too (each a query over
    the keys up to its own position; worker.engine.model_runner builds the tables)."""

    kernels: NativeKernels
    block_tables: torch.Tensor  # [n, max_blocks] int32 (a chunk's table once per row);
    # unused entries are never read
    context_lens: torch.Tensor  # [n] int32: keys each row sees, itself included
    window: int  # sliding window in tokens, 0 = none


@dataclass
class PrefillChunk:
    """Prompt tokens [start, end) of one sequence, at positions num_context.. onwards."""

    start: int
    end: int
    num_context: int  # tokens of this sequence already in the cache before this chunk
    # [KVH * nb] rows block * KVH + head, ordered (head, block), covering context + chunk;
    # None for a fresh prompt
    gather_index: torch.Tensor | None
    mask: torch.Tensor | None  # [q, k] bool (None: plain causal over the chunk itself)
    # [nb] int32: the sequence's blocks covering context + chunk, where the C prompt
    # kernel reads them in place (AttentionMetadata.prefill_kernels; gather_index and
    # mask then unused)
    block_table: torch.Tensor | None = None


class LayersRunner(Protocol):
    """Runs a step's decoder layers whole in place of the model's loop over them
    (worker.model.layer_stack.LayerStack): x [T, C] float32, the embedding's output, in
    place; cos, sin [T, D/2] float32; the model's caches -> what the loop returns."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    """Per-step inputs of every attention layer (built once, shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset)
    slot_blocks: torch.Tensor  # [T] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [T] int64: slot_mapping % block_size
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    in_place: InPlaceDecode | None
    block_size: int
    workspace: Workspace
    # CPU with float32 activations: the layer's per-token ops (norms, rotary + K/V
    # store) run as C kernels (worker.model.native), one call each
    layer_ops: NativeKernels | None = None
    # CPU: the dtype prefill attention's q, k and v are cast to for SDPA (None: as they
    # are); its output returns to the activations' dtype (worker.hardware.choose_prefill_attention)
    prefill_dtype: torch.dtype | None = None
    # CPU: the C prompt kernel, for chunks with a block table (else None)
    prefill_kernels: NativeKernels | None = None
    # CPU: the decoder's layers as one run of C calls, where this step is one it takes
    # whole (worker.model.layer_stack); None: layer by layer
    layer_stack: LayersRunner | None = None
    # whether a fresh prompt chunk attends to its own K/V through SDPA this step (the C
    # rotary op then returns k and v, else stores them only); derived once per step
    own_kv: bool = field(init=False)

    def __post_init__(self) -> None:
        self.own_kv = any(p.gather_index is None and p.block_table is None for p in self.prefills)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """[..., D] -> [..., D + 4 * D / group] int8 cache rows: each `group` of a row's values
    (default the whole row) as round(x * 127 / max|x|), then the groups' float32 scales
    max|x| / 127 as 4 bytes each (the C store's format, worker.model.native). A value's
    error is at most half its step, 1/254 of its group's largest value. The caches' groups
    are `native.i8_group`'s: keys 16 values, values the whole row."""
    D = x.shape[-1]
    group = group or D
    x = x.float().view(*x.shape[:-1], D // group, group)  # [..., groups, group]
    amax = x.abs().amax(-1, keepdim=True)  # [..., groups, 1]
    # 127 / amax as one IEEE division (a scalar over a tensor is torch's reciprocal, then
    # a product: two roundings), as the C store computes it
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div_(amax), 0.0)
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8).flatten(-2)
    scales = (amax / 127.0).flatten(-2).contiguous().view(torch.int8)  # [..., 4 * groups]
    return torch.cat([q, scales], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype, D: int) -> torch.Tensor:
    """[..., D + scales] int8 cache rows of D values (`quantize_rows`) -> [..., D] in
    `dtype`."""
    groups = (rows.shape[-1] - D) // I8_SCALE_BYTES
    scale = rows[..., D:].contiguous().view(torch.float32).unsqueeze(-1)  # [..., groups, 1]
    values = rows[..., :D].float().view(*rows.shape[:-1], groups, D // groups)
    return (values * scale).flatten(-2).to(dtype)


def widen(rows: torch.Tensor, dtype: torch.dtype, D: int) -> torch.Tensor:
    """Cache rows of D values as `dtype` values: int8 rows dequantized, others cast."""
    return dequantize_rows(rows, dtype, D) if rows.dtype == torch.int8 else rows.to(dtype)


def store_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D] (int8: native.cache_row)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Write this step's K/V into their cache slots."""
    # Advanced indices around a slice: the indexed view is [T, KVH, D], as k is. The
    # cache may be narrower than the activations (bfloat16 K/V beside a float32 residual
    # stream on CPU): values are rounded as they are stored, and widened where read; an
    # int8 cache (keys and values, or values alone) takes each row quantized with its scale.
    T, KVH, D = k.shape
    if k_cache.dtype == torch.int8:
        k = quantize_rows(k, i8_group(D, keys=True))
    if v_cache.dtype == torch.int8:
        v = quantize_rows(v, i8_group(D, keys=False))
    if key_pairs(k_cache):  # [NB, KVH, D / 2, BS, 2]: the indexed view is [T, KVH, D / 2, 2]
        k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k.view(T, KVH, D // 2, 2).to(
            k_cache.dtype
        )
    else:
        k_cache[meta.slot_blocks, :, meta.slot_offsets] = k.to(k_cache.dtype)
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor | None,  # [T, KVH, D]; needed only by prompt chunks through SDPA
    v: torch.Tensor | None,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D] (int8: native.cache_row)
    v_cache: torch.Tensor,  # likewise (int8 behind a bfloat16 k_cache: "bfloat16-int8")
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [>= T, H, D], contiguous; any float dtype
) -> torch.Tensor:
    """Attend over the cache, this step's K/V already stored: [T, H, D] in q's dtype, or
    written into the first T rows of `out` (the output projection's input, in its dtype
    and with its padding rows, which stay as they are) and `out` returned."""
    T, H, D = q.shape
    kvh = k_cache.shape[1]
    group = H // kvh
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    # D, or more for int8 rows (keys in pairs: D a key, gathered back into rows)
    k_row, v_row = D if key_pairs(k_cache) else k_cache.shape[-1], v_cache.shape[-1]
    # a head's rows of a block, one run: [num_blocks * KVH, block_size * row]
    k_runs = k_cache.view(-1, meta.block_size * k_row)
    v_runs = v_cache.view(-1, meta.block_size * v_row)
    ws = meta.workspace

    if meta.in_place is not None:
        d = meta.in_place
        n = d.context_lens.shape[0]
        # out is contiguous, so its first n rows are too; q is where the C layer ops made
        # it (else a view of the qkv projection: copied). The kernel computes in float32
        # whatever the cache holds and writes float32 or bfloat16: bf16 activations go
        # through a float32 copy ([n, H, D], small next to the context it reads).
        q_n = q[:n].float()
        direct = out.dtype in (torch.float32, torch.bfloat16)
        out_n = out[:n] if direct else torch.empty_like(q_n)
        d.kernels.paged_decode(
            q_n.contiguous(),
            k_cache,
            v_cache,
            d.block_tables,
            d.context_lens,
            out_n,
            scale,
            d.window,
        )
        if not direct:
            out[:n] = out_n

    for g in meta.decode_groups:
        n = g.end - g.start
        L = g.num_blocks * meta.block_size
        # contiguous per (sequence, KV head)
        kg = widen(
            _gather_keys(ws, k_cache, k_runs, g.gather_index).view(n * kvh, L, k_row), q.dtype, D
        )
        vg = widen(_gather(ws, "v", v_runs, g.gather_index).view(n * kvh, L, v_row), q.dtype, D)
        qg = q[g.start : g.end].reshape(n * kvh, group, D)  # G query heads share one KV head
        # Scores and softmax in float32 [n * KVH, G, L]; masked keys get -inf. Half
        # precision q and K (CUDA) are widened first: their product rounded to bfloat16
        # moved greedy picks (decode agreement 506 of 512 against 508, emulated on CPU).
        s = torch.bmm(qg.float(), kg.float().transpose(1, 2)).mul_(scale)
        s.view(n, kvh, group, L).masked_fill_(~g.mask, -torch.inf)
        probs = torch.softmax(s, -1).to(vg.dtype)
        out[g.start : g.end] = torch.bmm(probs, vg).view(n, H, D)

    # SDPA's inputs in the prefill dtype where one is set: each of q, k and v cast once for
    # the prompt rows, which follow the decode rows (a contiguous pass from the first
    # prompt's row `base`), rather than per prompt through a transposed view. A prefill
    # dtype and the C prompt kernel are never set together.
    base = 0
    narrow = meta.prefill_dtype
    if narrow is not None and meta.prefills:
        base = meta.prefills[0].start
        q = q[base:].to(narrow)
        k = None if k is None else k[base:].to(narrow)
        v = None if v is None else v[base:].to(narrow)
    for p in meta.prefills:
        lo, hi = p.start - base, p.end - base  # q's (and k's, v's) rows from base on
        if p.block_table is not None:
            assert meta.prefill_kernels is not None, "a block table is for the C prompt kernel"
            # float32 in and out: q as the C rotary op made it, else a copy; out's rows
            # directly where they are float32 (contiguous, as `out` is)
            qc = q[lo:hi].float().contiguous()
            direct = out.dtype == torch.float32
            oc = out[p.start : p.end] if direct else torch.empty_like(qc)
            meta.prefill_kernels.prefill_attention(
                qc, k_cache, v_cache, p.block_table, p.num_context, oc, scale
            )
            if not direct:
                out[p.start : p.end] = oc
            continue
        qp = q[lo:hi].transpose(0, 1)  # [H, L, D]
        if p.gather_index is None:
            assert k is not None and v is not None, "a fresh prompt chunk attends to its own K/V"
            kp = k[lo:hi].transpose(0, 1)  # [KVH, L, D]
            vp = v[lo:hi].transpose(0, 1)
        else:
            total = p.num_context + (p.end - p.start)
            kp = _gather_keys(ws, k_cache, k_runs, p.gather_index).view(kvh, -1, k_row)[:, :total]
            vp = _gather(ws, "v", v_runs, p.gather_index).view(kvh, -1, v_row)[:, :total]
            kp, vp = widen(kp, q.dtype, D), widen(vp, q.dtype, D)  # [KVH, total, D]
        # A leading batch dimension matters: 3-D inputs take SDPA's unfused math path
        # on CPU (4x slower at 512 tokens), 4-D ones its flash kernel.
        mask = None if p.mask is None else p.mask[None, None]
        o = F.scaled_dot_product_attention(
            qp[None],
            kp[None],
            vp[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.start : p.end] = o[0].transpose(0, 1)
    return out


def _gather(ws: Workspace, name: str, runs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The cache runs `index` names, in order, into the workspace's buffer `name`:
    [index.numel(), run] in the cache's dtype."""
    out = ws.get(name, index.numel(), runs.shape[1], runs.dtype)
    return torch.index_select(runs, 0, index, out=out)


def _gather_keys(
    ws: Workspace, k_cache: torch.Tensor, runs: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """`_gather` of key runs, as rows [index.numel(), BS * row] whatever their layout:
    keys in pairs ([D / 2, BS, 2] a run) put back in order, a copy."""
    out = _gather(ws, "k", runs, index)
    if not key_pairs(k_cache):
        return out
    _, _, half, BS, _ = k_cache.shape
    return out.view(-1, half, BS, 2).transpose(1, 2).reshape(out.shape[0], -1)


def decode_mask(
    context_lens: torch.Tensor,  # [n] int64
    num_keys: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """[n, 1, 1, num_keys] bool: key j of row i is visible iff j < len_i (and inside the window)."""
    j = torch.arange(num_keys, device=context_lens.device)
    visible = j[None, :] < context_lens[:, None]
    if sliding_window is not None:
        visible &= j[None, :] >= (context_lens[:, None] - sliding_window)
    return visible[:, None, None, :]


def prefill_mask(
    num_context: int, num_query: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[q, k] bool causal mask shifted by num_context; None when plain causal suffices."""
    if num_context == 0 and (sliding_window is None or num_query <= sliding_window):
        return None
    qpos = torch.arange(num_context, num_context + num_query, device=device)[:, None]
    kpos = torch.arange(num_context + num_query, device=device)[None, :]
    visible = kpos <= qpos
    if sliding_window is not None:
        visible &= kpos > qpos - sliding_window
    return visible
