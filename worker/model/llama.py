"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) on a paged KV cache.

The forward pass takes a flat batch of T tokens from many sequences (prefill chunks
and decode tokens mixed), their positions and the attention metadata; the model holds
weights only, the KV cache tensors are passed in by the runner.
Shapes: T tokens, H heads, KVH kv heads, D head_dim, C hidden size.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionMetadata, paged_attention, store_kv
from worker.model.candidates import greedy_pick, top_candidates
from worker.model.config import ModelConfig
from worker.model.native import Int16Weight, NativeKernels
from worker.model.quant import Int8Linear

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([NB, BS, KVH, D], [NB, BS, KVH, D])
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D/2] each
LinearPath = Literal["int16", "rows", "torch"]  # the kernel a Linear's matmul runs

# Candidates per row scored again at full precision behind a narrow output projection.
RESCORED = 16
# Linear layers of at most this many rows (decode steps, short prompt chunks) run through
# the C bfloat16 kernel (kernels/small_matmul.c) where the layer holds a copy of its weight
# in that kernel's layout (`Linear.rows_weight`, worker.model.packing.attach_rows_weights).
# The default model's decoder layers, 2 threads, AMD EPYC Zen 4, against oneDNN's packed
# matmul, alone: 0.48-0.56x the time at 1-2 rows (weights streaming from memory),
# 0.59-0.78x at 4-16, 0.78-0.90x at 24-64, 0.87-0.91x at 96-128; decode steps 0.78x /
# 0.84x / 0.88x / 0.90x at batch 8 / 16 / 32 / 64, a prompt step of 128 tokens 0.88x. From
# 256 rows on, prompt steps took the same time either way (0.99-1.03x at 256-1,024): oneDNN
# keeps them.
ROWS_KERNEL_MAX = 128
# Below this hidden size a narrow output projection costs more than it saves: its
# fixed part (widening [S, V] logits, picking candidates) stays while the matmul it
# shortens shrinks with the hidden size. Batch 64, vocabulary 49152, one thread (Intel
# Xeon with AMX): float32 3.4 / 6.8 / 14.5 / 36.4 ms against bfloat16 with re-scoring
# 4.9 / 5.7 / 9.4 / 14.5 ms at hidden sizes 64 / 128 / 256 / 576.
NARROW_HEAD_MIN_HIDDEN = 128


class Linear(nn.Module):
    """nn.Linear without the random initialisation: weights always come from a checkpoint.

    The weights may be in a narrower dtype than the activations (bfloat16 weights with
    a float32 residual stream on CPU): the input is cast to the weights' dtype for the
    matmul and the output back, so only the matmul runs narrow. Its rows are then padded
    to a bucket (`padded_rows`): oneDNN builds a bf16 kernel for every new row count
    (~10 ms each here), and a continuous batch changes its token count every step.

    On CPU the weight may be packed once for oneDNN (`pack`, worker.model.packing): the
    same Parameter then holds an opaque mkldnn tensor (same shape and dtype) and the
    matmul runs on it without copying the weight into the kernel's layout at every call.
    Packed float32 weights are padded like narrow ones, for the same reason.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the same weight in the C row kernel's layout (worker.model.native.rows_layout),
        # or None: see `matmul`
        self.rows_weight: torch.Tensor | None = None
        # a float32 weight rounded for 16-bit integer products (worker.model.native.
        # int16_layout, worker.model.packing.attach_int16_weights), or None: see `matmul`
        self.int16_weight: Int16Weight | None = None

    def forward(self, x: torch.Tensor, ops: NativeKernels | None = None) -> torch.Tensor:
        """[rows, in] -> [rows, out] in x's dtype; `ops`: see `matmul`."""
        rows = x.shape[0]
        # Same dtype (CUDA; float32 on CPU): straight to the matmul, unless the weight is
        # packed for oneDNN, whose rows go to a bucket.
        bucketed = self.packed and self.rows_for(rows) != rows
        if x.dim() != 2 or (x.dtype == self.weight.dtype and not bucketed):
            return self.matmul(x)
        return self.forward_narrow(x, ops).to(x.dtype)

    def forward_narrow(self, x: torch.Tensor, ops: NativeKernels | None = None) -> torch.Tensor:
        """[rows, in] -> [rows, out] in the weights' dtype: x cast and padded for the
        matmul, the result left as the matmul gives it."""
        return self.matmul(self.narrow_input(x), x.shape[0], ops)[: x.shape[0]]

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def pack(self, rows: int) -> None:
        """Reorder the weight once into oneDNN's blocked layout, chosen for about `rows`
        rows of input (any row count runs on it). Results differ from the plain matmul's
        by summation order at most (bfloat16: none on the AMD EPYC measured)."""
        if not self.packed:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
            self.weight = nn.Parameter(packed, requires_grad=False)

    def unpack(self) -> None:
        """Back to a plain [out, in] weight (exactly the one packed)."""
        if self.packed:
            self.weight = nn.Parameter(self.weight.detach().to_dense(), requires_grad=False)

    def rows_for(self, rows: int) -> int:
        """The row count this layer's matmul takes for `rows` rows of input."""
        plain = self.weight.dtype == torch.float32 and not self.packed
        return rows if plain else padded_rows(rows)

    def narrow_input(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows_for(rows), in] in the weights' dtype, the padding zeroed."""
        w = self.weight
        rows, padded = x.shape[0], self.rows_for(x.shape[0])
        if padded == rows:
            return x.to(w.dtype)  # [R, in]
        # Cast into a fresh buffer and zero only the padding (new_zeros then a copy
        # wrote every row twice: 5-8% of the linear layers' time at batch 16-64).
        xp = torch.empty((padded, x.shape[1]), dtype=w.dtype, device=x.device)  # [R', in]
        xp[:rows] = x
        xp[rows:].zero_()
        return xp

    def path(self, tokens: int | None, ops: NativeKernels | None) -> LinearPath:
        """Which kernel `matmul` runs for `tokens` real rows (None: all of them) with the C
        kernels `ops` (or None): "int16" (the 16-bit integer products), "rows" (the C row
        kernel) or "torch" (oneDNN's packed matmul, or F.linear). The layer stack asks the
        same question once for the steps it takes (worker.model.layer_stack)."""
        if ops is None:
            return "torch"
        if self.int16_weight is not None:
            return "int16"
        if self.rows_weight is not None and tokens is not None and tokens <= ROWS_KERNEL_MAX:
            return "rows"
        return "torch"

    def matmul(
        self, xp: torch.Tensor, tokens: int | None = None, ops: NativeKernels | None = None
    ) -> torch.Tensor:
        """[R, in] already in the weights' dtype (with `rows_for` rows where the weights are
        narrower than float32) -> [R, out], same dtype. Where the caller says only the first
        `tokens` rows are real (the rest padding), at most ROWS_KERNEL_MAX of them, and passes
        the C kernels, a layer holding `rows_weight` computes them with the C row kernel
        (padding rows zeroed, as the padded matmul leaves them). With the C kernels a
        float32 layer holding `int16_weight` computes all its rows as 16-bit integer
        products (its weight is plain then: no padding rows)."""
        path = self.path(tokens, ops)
        if path == "int16":
            assert ops is not None and self.int16_weight is not None
            return ops.linear_i16(xp, self.int16_weight, self.bias)
        if path == "rows":
            assert ops is not None and self.rows_weight is not None and tokens is not None
            return ops.matmul_rows(xp, self.rows_weight, tokens)
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                xp, self.weight, self.bias, "none", [], ""
            )
            return out
        return F.linear(xp, self.weight, self.bias)


def padded_rows(rows: int) -> int:
    """Row count rounded up to one of a few dozen buckets: multiples of 8 up to 64, of
    32 up to 256, of 128 beyond (at most 1/8 extra work past 64 rows)."""
    step = 8 if rows <= 64 else 32 if rows <= 256 else 128
    return -(-rows // step) * step


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as the reference does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, 'rotate half' layout; cos/sin tables in the model dtype."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Angles in float32 (exact for the positions used), stored in the model dtype
        # once `.to(dtype)` is applied to the module, as the reference applies them.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), cfg.inv_freq())
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D/2] (computed once per step)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused: one matmul instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rope: Rope, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.rotate(q, *rope), Rotary.rotate(k, *rope)
        store_kv(k, v, kv[0], kv[1], meta)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, H, D]
        out: torch.Tensor = self.o_proj(o.view(T, self.q_size))
        return out

    def forward_ops(
        self, h: torch.Tensor, T: int, rope: Rope, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`forward` through the C layer ops: h [R, C] normed rows in the linear layers'
        dtype (R = qkv_proj.rows_for(T)) -> [R, C] o_proj output in that dtype."""
        assert meta.layer_ops is not None and isinstance(self.qkv_proj, Linear)
        assert isinstance(self.o_proj, Linear)
        cos, sin = (t.view(T, -1) for t in rope)  # [T, D/2]
        # rotary on q and k, the K/V store and the widening to float32 in one pass; k and
        # v come back only for a fresh prompt chunk, which attends to them through SDPA
        ops = meta.layer_ops
        q, k, v = ops.rope_store(
            self.qkv_proj.matmul(h, T, ops),
            cos,
            sin,
            meta.slot_mapping,
            *kv,
            self.num_heads,
            meta.own_kv,
        )  # [T, H, D], [T, KVH, D] x 2 (or None), float32, contiguous
        # attention written straight into o_proj's input: its dtype, its padded rows
        rows = self.o_proj.rows_for(T)
        o = torch.empty((rows, self.num_heads, self.head_dim), dtype=self.o_proj.weight.dtype)
        if rows > T:
            o[T:].zero_()
        paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, out=o)  # [R, H, D]
        return self.o_proj.matmul(o.view(rows, self.q_size), T, ops)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        # gate and up projections fused: [C] -> [2 * I]
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out

    def forward_ops(self, h: torch.Tensor, tokens: int, ops: NativeKernels) -> torch.Tensor:
        """`forward` with SiLU and multiply as one C pass; h [R, C] in the linear layers'
        dtype, `tokens` rows and the padding `rows_for` adds -> [R, C] in that dtype."""
        assert isinstance(self.gate_up_proj, Linear) and isinstance(self.down_proj, Linear)
        gate_up = self.gate_up_proj.matmul(h, tokens, ops)  # [R, 2 * I]
        down = self.down_proj
        if down.path(tokens, ops) == "int16":
            # float32 layers hold no padding rows (R == tokens): SiLU and multiply happen
            # as the int16 products round their inputs, the [R, I] product never stored
            assert down.int16_weight is not None
            return ops.linear_i16_silu(gate_up, down.int16_weight, down.bias)
        return down.matmul(ops.silu_mul(gate_up, gate_up.dtype, tokens), tokens, ops)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv: KVCache,
        meta: AttentionMetadata,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, C] float32 residual stream -> (x, pending): the stream and, through the C
        layer ops, the MLP output not yet added to it ([R, C] in the linear layers' dtype;
        None through torch ops). `pending` is the previous layer's, added here."""
        ops = meta.layer_ops  # set only where every layer `takes_layer_ops`
        if ops is None:
            if pending is not None:
                x = x + pending[: x.shape[0]]
            x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
            return x + self.mlp(self.post_attention_layernorm(x)), None
        # The same through the C layer ops. Between them the rows stay in the linear
        # layers' dtype, padded as their matmuls take them (the casts to and from the
        # float32 residual stream happen inside the ops). Both residual adds are folded
        # into the norm that follows them (x += residual, in place: x is this step's
        # own), so the MLP's output is handed to the next layer's first norm: on an
        # Intel Xeon with AMX a separate add of 64 rows after the MLP's matmuls took
        # 20-40 us (inputs no longer in cache); batch-64 steps 0.98-0.99x without it.
        T, eps = x.shape[0], self.input_layernorm.eps
        dtype = self.mlp.down_proj.weight.dtype
        rows = self.self_attn.qkv_proj.rows_for(T)
        w1, w2 = self.input_layernorm.weight, self.post_attention_layernorm.weight
        h = ops.rms_norm(x, w1, eps, residual=pending, out_dtype=dtype, rows=rows)
        a = self.self_attn.forward_ops(h, T, rope, kv, meta)  # [R, C]
        h = ops.rms_norm(x, w2, eps, residual=a, out_dtype=dtype, rows=rows)
        return x, self.mlp.forward_ops(h, T, ops)  # [R, C], added by the next layer

    @property
    def takes_layer_ops(self) -> bool:
        """Whether the C layer ops apply: plain Linear layers (not int8 ones) all in float32
        or all in bfloat16, no q/k norm (it comes between the projection and the rotary)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.q_norm is not None or not all(isinstance(m, Linear) for m in linears):
            return False
        dtype = attn.qkv_proj.weight.dtype
        return dtype in (torch.float32, torch.bfloat16) and all(
            m.weight.dtype == dtype for m in linears
        )


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; `forward` returns hidden states, `compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.narrow_head: Linear | Int8Linear | None = None  # see `narrow_output_projection`
        self.float_head: torch.Tensor | None = None  # see `float_output_projection`

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, C]
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions)
        if meta.layer_stack is not None:  # the same kernels, without the Python between
            T = x.shape[0]
            cos, sin = (t.view(T, -1) for t in rope)  # [T, D/2]
            return meta.layer_stack.forward(x, cos, sin, kv_caches, meta)
        pending: torch.Tensor | None = None  # the last MLP output not yet in x
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, pending = layer(x, rope, kv, meta, pending)
        if pending is not None:
            x += pending[: x.shape[0]]  # x is the embedding's output: this step's own
        out: torch.Tensor = x
        return out

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection's weight [V, C]: the embedding table where it is tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def narrow_output_projection(self, dtype: torch.dtype, reduce_range: bool = False) -> None:
        """Compute the logits through a `dtype` copy of the output projection, then score
        the best RESCORED candidates of each row again in the projection's own dtype.
        `torch.qint8` means an Int8Linear copy (`reduce_range` as for the decoder's).

        On a CPU with bfloat16 linear layers the float32 projection (vocabulary x hidden,
        the largest matrix of a small model) took ~30% of a batch-64 decode step against
        ~5% in bfloat16; a bfloat16 projection alone moved the default model's greedy
        pick off float32's at ~0.7% more positions. Re-scored exactly, the candidates
        that can win keep float32's values (greedy picks equal float32's unless float32's
        best is outside the narrow copy's top RESCORED); the rest of the row, which only
        weighs in a sampled draw, keeps the narrow copy's rounding.
        """
        weight = self.output_weight
        if weight.dtype == dtype:
            return
        if dtype == torch.qint8:
            self.narrow_head = Int8Linear(weight, None, reduce_range)
            return
        head = Linear(self.config.hidden_size, self.config.vocab_size)
        head.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
        self.narrow_head = head

    def float_output_projection(self) -> None:
        """Compute the logits of a half-precision model (CUDA) in float32: a float32 copy
        of the output projection [V, C] against the final norm's output widened. Logits
        rounded to bfloat16 (8 significand bits) flip near-ties: with the default model
        in bfloat16 throughout, as on CUDA (emulated on CPU), the greedy pick agreed with
        float32's at 503 of 512 positions under teacher forcing, 510 with float32 logits
        (the bar is 99%). Costs V x C x 4 bytes (113 MB for the default model; an untied
        model keeps its half-precision lm_head beside the copy)."""
        self.float_head = self.output_weight.detach().float()

    def compute_logits(
        self, hidden: torch.Tensor, ops: NativeKernels | None = None
    ) -> torch.Tensor:
        """[S, C] hidden states of the positions that sample -> [S, V] float32 logits; with
        `ops`, a narrow head holding `rows_weight` takes the C row kernel."""
        h = self.norm(hidden)
        if self.float_head is not None:
            return F.linear(h.float(), self.float_head)
        weight = self.output_weight
        head = self.narrow_head
        if head is None:
            return F.linear(h.to(weight.dtype), weight).float()
        k = min(RESCORED, weight.shape[0])
        if self._narrow_in_c(ops):
            assert ops is not None and isinstance(head, Linear)
            # [S, V] bfloat16, widened and its candidates picked in one pass over each row
            # (kernels/logits.c) rather than three of torch's: with the sampler's argmax
            # in C too, batch-64 decode steps 0.94-0.96x the time, batch 32 0.97x, batch
            # 16 0.98x (Intel Xeon with AMX, both ways alternating step by step)
            logits, top = ops.widen_top(head.forward_narrow(h, ops), k)
        else:
            # [S, V], the narrow copy's rounding
            logits = (head(h, ops) if isinstance(head, Linear) else head(h)).float()
            # Block maxima first, then topk over the best blocks: ~4x torch's topk over
            # the whole row of a vocabulary this size on CPU.
            top = top_candidates(logits, k)[1]  # [S, k]
        out: torch.Tensor = logits.scatter_(1, top, self._rescored(h, top))
        return out

    def greedy_tokens(self, hidden: torch.Tensor, ops: NativeKernels | None) -> torch.Tensor:
        """[S, C] hidden states of the positions that sample -> [S] int64, the argmax of
        each row of compute_logits(hidden, ops), for a step whose rows all pick greedily,
        where picks_greedily(ops). The logits are never widened: only each row's
        candidates are found in the narrow head's bfloat16 logits and scored again
        (logits.c, candidates.greedy_pick), where compute_logits writes [S, V] float32
        that the sampler's argmax reads back (12.6 MB each way at 64 rows of a
        49,152-token vocabulary)."""
        head = self.narrow_head
        if not self.picks_greedily(ops):
            raise ValueError(
                "greedy_tokens needs a bfloat16 narrow output projection and the C kernels "
                "(picks_greedily)"
            )
        assert ops is not None and isinstance(head, Linear)
        h = self.norm(hidden)
        narrow = head.forward_narrow(h, ops)  # [S, V] bfloat16
        top = ops.top_columns(narrow, min(RESCORED, self.output_weight.shape[0]))  # [S, k]
        return greedy_pick(narrow, top, self._rescored(h, top))

    def picks_greedily(self, ops: NativeKernels | None) -> bool:
        """Whether greedy_tokens can pick a greedy step's tokens with these kernels."""
        return self.float_head is None and self._narrow_in_c(ops)

    def _narrow_in_c(self, ops: NativeKernels | None) -> bool:
        """Whether the narrow head's logits and candidates take the C kernels."""
        head = self.narrow_head
        return ops is not None and isinstance(head, Linear) and head.weight.dtype == torch.bfloat16

    def _rescored(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The candidates top [S, k] of the normed rows h [S, C] scored again in the output
        projection's own dtype -> [S, k] float32: [S, k, C] candidate rows (an embedding
        lookup: half aten::index's time) @ [S, C, 1]."""
        weight = self.output_weight
        exact = torch.bmm(F.embedding(top, weight), h.to(weight.dtype).unsqueeze(-1)).squeeze(-1)
        return exact.float()
