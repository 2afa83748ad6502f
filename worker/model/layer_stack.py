"""The decoder's layers of one step as a single run of C calls (CPU).

Through the C layer ops (`DecoderLayer.forward` with `ops`) a layer is nine kernel
calls: norm, qkv projection, rotary and K/V store, attention read in place, output
projection, residual add and norm, gate and up projection, SiLU and multiply, down
projection. Each goes through a Python wrapper that checks its arguments, allocates its
output and pads its rows for oneDNN, and the modules around them are looked up
attribute by attribute: ~5 ms a step for the default model's 30 layers, a third of a
decode step of one sequence (AMD EPYC Zen 4, 2 threads). A `LayerStack` makes those
calls itself, straight into the library with the arguments it worked out once (weights
and caches by address, outputs into buffers it owns, no padding rows), for the steps
its kernels take whole:

- every row attended in place by the C kernel (`AttentionMetadata.in_place` covers all
  T rows: decode tokens, and prompt rows where prefill attention is "native"; no chunk
  left to SDPA), at most MAX_ROWS of them;
- the layers it was built over, unchanged.

Each linear layer is computed as the per-op path computes it (`Linear.matmul`): through
the row kernel's bfloat16 weights (`Linear.rows_weight`, no bias), the int16 products'
(`Linear.int16_weight`), or else through torch (oneDNN's packed matmul, or F.linear) on
the layer's own weight and bias. The last is one torch call a layer, on a view of the
stack's buffer with the rows padded as `Linear.rows_for` pads them (padding zeroed once a
step: the C kernels write only the step's rows); it is how the stack runs where the
linear layers are oneDNN's (a model too large for the row kernel's copy; a CPU without
avx512_bf16 where bfloat16 was asked for) and the layers whose bias the row kernel does
not take (Qwen2's q, k and v projections).

The kernels, their order and their inputs are the per-op path's, so the results are the
same bit for bit (tests/model/test_layer_stack.py); only the Python between them goes.
Where every linear layer is a C kernel's (the row kernel or the int16 products: no torch
matmul), the loop over the layers itself runs in C (kernels/layer_stack.c): one ctypes
call a step rather than nine a layer.

Buffers (float32 or bfloat16 rows of the step's activations; R = MAX_ROWS):
  h [R, C]   normed rows, the projections' input       qkv [R, (H + 2 KVH) D]
  q [R, H, D] float32, rotary applied                   o [R, H D]  attention out
  a [R, C]   output projection                          gu [R, 2 I] gate and up
  act [R, I] silu(gate) * up                            m [R, C]    the MLP's output
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker.model.llama import (
    ROWS_KERNEL_MAX,
    DecoderLayer,
    Linear,
    LinearPath,
    LlamaForCausalLM,
    padded_rows,
)
from worker.model.native import NativeKernels, int16_scratch_bytes, key_pairs, store_flags

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata, InPlaceDecode, PrefillChunk

# Rows a step may have for the stack to take it: the row kernel's limit (its buffers are
# sized for it; larger prompt steps are arithmetic, where the Python around them is noise).
MAX_ROWS = ROWS_KERNEL_MAX


@dataclass(frozen=True)
class _LinearCall:
    """One linear layer as the stack computes it: `kind` "rows" (the C row kernel, by
    address: weight), "int16" (the C int16 products: weight, scale, bias or 0) or "torch"
    (oneDNN's packed matmul or F.linear on `weight` and `bias`, rows padded where `pads`)."""

    kind: LinearPath
    ptrs: tuple[int, int, int] = (0, 0, 0)
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    packed: bool = False
    pads: bool = False

    @staticmethod
    def of(m: Linear, kernels: NativeKernels) -> _LinearCall:
        """m as `Linear.matmul` computes it with the C ops at <= MAX_ROWS rows."""
        kind = m.path(MAX_ROWS, kernels)
        if kind == "int16":
            w = m.int16_weight
            assert w is not None
            bias = m.bias.data_ptr() if m.bias is not None else 0
            return _LinearCall(kind, (w.wq.data_ptr(), w.scale.data_ptr(), bias))
        if kind == "rows":
            assert m.rows_weight is not None
            assert m.bias is None  # attach_rows_weights copies bias-free layers only
            return _LinearCall(kind, (m.rows_weight.data_ptr(), 0, 0))
        pads = m.rows_for(1) != 1
        return _LinearCall("torch", weight=m.weight, bias=m.bias, packed=m.packed, pads=pads)


@dataclass(frozen=True)
class _Weights:
    """One layer's weights and caches as the stack reads them, by address (the objects
    that hold them are kept alive and watched by `LayerStack.current`)."""

    norm1: int
    norm2: int
    eps: float
    scale: float
    linears: tuple[_LinearCall, ...]  # qkv, o, gate and up, down
    k_cache: int
    v_cache: int


class _CLayer(ctypes.Structure):
    """kernels/layer_stack.c's kvflow_stack_layer: one layer's weights and caches."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("kind", ctypes.c_int * 4),
        ("w", ctypes.c_void_p * 4),
        ("ws", ctypes.c_void_p * 4),
        ("bias", ctypes.c_void_p * 4),
    ]


class _CStack(ctypes.Structure):
    """kernels/layer_stack.c's kvflow_stack: the layers, the decode entry, the shapes, the
    buffers; failed_layer and failed_op written where a kernel refuses."""

    _fields_ = [
        ("layers", ctypes.c_void_p),
        ("decode", ctypes.c_void_p),
        *((name, ctypes.c_int) for name in ("L", "C", "H", "KVH", "D", "inter", "BS")),
        *((name, ctypes.c_int) for name in ("act_bf16", "cache_bf16", "k_i8", "v_i8", "k_pairs")),
        *((name, ctypes.c_void_p) for name in ("h", "qkv", "o", "a", "gu", "act", "m", "q")),
        ("scratch", ctypes.c_void_p),
        ("xq_bytes", ctypes.c_size_t),
        ("failed_layer", ctypes.c_int),
        ("failed_op", ctypes.c_int),
    ]


# layer_stack.c's kinds of linear layer, and the names of the ops that can refuse
_C_KINDS = {"rows": 0, "int16": 1}
_C_OPS = ("qkv projection", "output projection", "gate and up projection", "down projection")


def _refusal(op: int, rows: int, status: int) -> str:
    """What layer_stack.c's failed_op and status say: a linear layer's kernel (ops 0-3),
    or attention (4)."""
    if op == len(_C_OPS):
        return f"paged decode attention failed ({status})"
    return f"the {_C_OPS[op]}'s kernel refused {rows} rows ({status})"


# (attribute table, key, the object found there when the stack was built)
Watched = tuple[dict[str, object], str, object]


def _watched(model: LlamaForCausalLM) -> list[Watched]:
    """Everything the stack reads, and the owner's table it sits in: each layer, its norms
    and their weights, its four linear layers and, for each, its weight (a repack replaces
    it), the int16 weight (values and scales), the row kernel's copy and the bias (each or
    None). The tables are read directly because nn.Module's lookup of a submodule or
    parameter costs ~1 us: 300 us a step over the default model's layers, against 16 us
    this way."""
    out: list[Watched] = []

    def keep(table: dict[str, object], key: str) -> object:
        out.append((table, key, table.get(key)))
        return table.get(key)

    layers: dict[str, object] = model.layers._modules  # type: ignore[assignment]
    for i in range(len(model.layers)):
        layer = keep(layers, str(i))
        assert isinstance(layer, DecoderLayer)
        parts: dict[str, object] = layer._modules  # type: ignore[assignment]
        for name in ("input_layernorm", "post_attention_layernorm"):
            keep(keep(parts, name)._parameters, "weight")  # type: ignore[attr-defined]
        for owner, names in (
            ("self_attn", ("qkv_proj", "o_proj")),
            ("mlp", ("gate_up_proj", "down_proj")),
        ):
            block = keep(parts, owner)
            for name in names:
                m = keep(block._modules, name)  # type: ignore[attr-defined]
                keep(m._parameters, "weight")  # type: ignore[attr-defined]
                keep(vars(m), "int16_weight")
                keep(vars(m), "rows_weight")
                keep(m._parameters, "bias")  # type: ignore[attr-defined]
    return out


def _decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    layers = list(model.layers)
    assert all(isinstance(layer, DecoderLayer) for layer in layers)
    return layers  # type: ignore[return-value]


def _layer_linears(layer: DecoderLayer) -> list[Linear]:
    """qkv, o, gate and up, down: plain Linears where the layer takes the C layer ops."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return [m for m in linears if isinstance(m, Linear)]


class LayerStack:
    """Runs a step's decoder layers as one run of C calls (module docstring): `takes`
    says whether it may, `forward` does it."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: NativeKernels,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
    ) -> None:
        cfg = model.config
        self.model = model
        self.kv_caches = kv_caches  # read by address: held here, checked at each step
        self.lib = kernels.lib
        self.block_size = block_size
        self.C, self.H, self.KVH, self.D = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.inter = cfg.intermediate_size
        first = _decoder_layers(model)[0]
        # activations between the ops: the linear layers' dtype, as the per-op path takes
        # it (bfloat16 for the row kernel, float32 into and out of the int16 products)
        act = first.mlp.down_proj.weight.dtype
        self.act_bf16 = int(act == torch.bfloat16)
        k_dtype, v_dtype = kv_caches[0][0].dtype, kv_caches[0][1].dtype
        self.store_flags = store_flags(k_dtype, v_dtype, self.D)  # kvflow_rope_store's
        # bfloat16 keys in pairs within a block, or rows (native.key_pairs)
        self.k_pairs = int(key_pairs(kv_caches[0][0]))
        self.decode = kernels.decode_entry(*kv_caches[0])
        R, C, H, D, inter = MAX_ROWS, self.C, self.H, self.D, self.inter
        qkv_cols = (H + 2 * self.KVH) * D
        self.buffers = {
            "h": torch.empty(R, C, dtype=act),
            "qkv": torch.empty(R, qkv_cols, dtype=act),
            "q": torch.empty(R, H, D, dtype=torch.float32),
            "o": torch.empty(R, H * D, dtype=act),
            "a": torch.empty(R, C, dtype=act),
            "gu": torch.empty(R, 2 * inter, dtype=act),
            "act": torch.empty(R, inter, dtype=act),
            "m": torch.empty(R, C, dtype=act),
        }
        # the int16 products' rounded inputs, laid out as NativeKernels.linear_i16 lays
        # them, for the widest of the layers' inputs
        self._xq_bytes, scratch_bytes = int16_scratch_bytes(R, max(C, H * D, inter))
        self.scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        self.layers = [
            self._weights(layer, kv, kernels)
            for layer, kv in zip(_decoder_layers(model), kv_caches, strict=True)
        ]
        self._watched = _watched(model)
        calls = [call for w in self.layers for call in w.linears]
        # whether torch's matmuls take rows padded as `Linear.rows_for` pads them (their
        # inputs' padding then zeroed), and whether any linear layer goes through torch
        self.pads = any(call.pads for call in calls)
        self.torch_linears = any(call.kind == "torch" for call in calls)
        # the last layer's MLP output, which forward adds to x: torch's tensor or buffer m
        self._last_m_torch = bool(self.layers) and self.layers[-1].linears[3].kind == "torch"
        # the buffers' addresses, for the calls (the buffers never move)
        self._ptr = {k: v.data_ptr() for k, v in self.buffers.items()}
        # the loop in C where no layer goes through torch (None: the Python loop below);
        # the C struct reads the layers' array by address, so it is held here too
        self._c_layers: ctypes.Array[_CLayer] | None = None
        self.c_stack: _CStack | None = None
        if not self.torch_linears:
            self._c_layers, self.c_stack = self._c_stack()

    def _c_stack(self) -> tuple[ctypes.Array[_CLayer], _CStack]:
        """The stack as layer_stack.c reads it: the layers' array and the struct that
        points to it. The mirrors' sizes are checked against the C structs'."""
        sizes = (ctypes.c_size_t * 2)()
        self.lib.kvflow_layer_stack_sizes(sizes)
        if tuple(sizes) != (ctypes.sizeof(_CLayer), ctypes.sizeof(_CStack)):
            raise RuntimeError(
                f"layer_stack.c's structs are {tuple(sizes)} bytes, their mirrors here "
                f"{(ctypes.sizeof(_CLayer), ctypes.sizeof(_CStack))}"
            )
        layers = (_CLayer * len(self.layers))()
        for c, w in zip(layers, self.layers, strict=True):
            c.norm1, c.norm2, c.eps, c.scale = w.norm1, w.norm2, w.eps, w.scale
            c.k_cache, c.v_cache = w.k_cache, w.v_cache
            for i, call in enumerate(w.linears):
                c.kind[i] = _C_KINDS[call.kind]
                c.w[i], c.ws[i], c.bias[i] = call.ptrs
        b = self._ptr
        cache_bf16, k_i8, v_i8 = self.store_flags
        return layers, _CStack(
            ctypes.addressof(layers),
            ctypes.cast(self.decode, ctypes.c_void_p).value,  # type: ignore[arg-type]
            len(self.layers), self.C, self.H, self.KVH, self.D, self.inter, self.block_size,
            self.act_bf16, cache_bf16, k_i8, v_i8, self.k_pairs,
            b["h"], b["qkv"], b["o"], b["a"], b["gu"], b["act"], b["m"], b["q"],
            self.scratch.data_ptr(), self._xq_bytes, -1, -1,
        )  # fmt: skip

    def describe(self) -> str:
        """The stack for the start-up facts: which steps it takes and how it runs them."""
        how = " and torch matmuls" if self.torch_linears else ", the loop over the layers in C too"
        return (
            f"steps of <= {MAX_ROWS} rows attended in place run the layers as one run of C "
            f"calls{how}"
        )

    @staticmethod
    def fits(model: LlamaForCausalLM, kernels: NativeKernels | None) -> str | None:
        """Why a stack cannot run this model's layers, or None where it can: every layer
        takes the C layer ops, with four plain linear layers of one dtype throughout (each
        computed as `Linear.matmul` computes it: see `_LinearCall`)."""
        if kernels is None:
            return "no C kernels"
        dtypes: set[torch.dtype] = set()
        for layer in model.layers:
            if not isinstance(layer, DecoderLayer) or not layer.takes_layer_ops:
                return "layers the C layer ops do not take"
            linears = _layer_linears(layer)
            if len(linears) != 4:
                return "linear layers other than plain ones"
            dtypes.update(m.weight.dtype for m in linears)
        if len(dtypes) != 1:
            return "linear layers of differing dtypes"
        return None

    @staticmethod
    def _weights(
        layer: DecoderLayer, kv: tuple[torch.Tensor, torch.Tensor], kernels: NativeKernels
    ) -> _Weights:
        return _Weights(
            norm1=layer.input_layernorm.weight.data_ptr(),
            norm2=layer.post_attention_layernorm.weight.data_ptr(),
            eps=layer.input_layernorm.eps,
            scale=layer.self_attn.scale,
            linears=tuple(_LinearCall.of(m, kernels) for m in _layer_linears(layer)),
            k_cache=kv[0].data_ptr(),
            v_cache=kv[1].data_ptr(),
        )

    def current(self) -> bool:
        """Whether the model still holds every layer, weight and copy the stack was built
        over (a benchmark that swaps them, or a repack, makes the stack step aside)."""
        return len(self.model.layers) == len(self.layers) and all(
            table.get(key) is held for table, key, held in self._watched
        )

    def takes(
        self, rows: int, in_place: InPlaceDecode | None, prefills: list[PrefillChunk]
    ) -> bool:
        """Whether a step of `rows` tokens, with these parts of its attention metadata, is
        one the stack runs whole: all its rows attended in place (through the C layer ops,
        which the stack is built only where steps take)."""
        return (
            0 < rows <= MAX_ROWS
            and not prefills
            and in_place is not None
            and in_place.context_lens.shape[0] == rows
            and self.current()
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, C] float32 (the embedding's output, this step's own) through every
        decoder layer, in place, the last MLP output added: what the layers' loop in
        `LlamaForCausalLM.forward` returns. cos, sin [T, D/2] float32, contiguous;
        `kv_caches` must be the ones the stack was built over."""
        d = meta.in_place
        if kv_caches is not self.kv_caches or d is None or not 0 < x.shape[0] <= MAX_ROWS:
            raise ValueError("the layer stack was handed a step it does not take (see takes)")
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"the layer stack takes contiguous float32 rows, not {x.dtype}")
        T, C, H, KVH, D, inter = x.shape[0], self.C, self.H, self.KVH, self.D, self.inter
        # rows the buffers carry: T, or T padded where torch's matmuls take padded rows
        # (the norms and silu_mul zero their outputs' padding; attention's, zeroed here,
        # stays zero: nothing else writes those rows)
        R = padded_rows(T) if self.pads else T
        if R > T:
            self.buffers["o"][T:R].zero_()
        lib, b = self.lib, self._ptr
        act, bs = self.act_bf16, self.block_size
        slots = meta.slot_mapping
        tables, lens = d.block_tables, d.context_lens
        x_p, cos_p, sin_p = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        slots_p, tables_p, lens_p = slots.data_ptr(), tables.data_ptr(), lens.data_ptr()
        max_blocks, window = tables.shape[1], d.window
        if self.c_stack is not None:
            c = self.c_stack
            status = lib.kvflow_layer_stack(
                ctypes.byref(c), x_p, cos_p, sin_p, slots_p, tables_p, lens_p,
                T, max_blocks, window,
            )  # fmt: skip
            if status:
                raise RuntimeError(f"layer {c.failed_layer}: {_refusal(c.failed_op, T, status)}")
            x += self.buffers["m"][:T]
            return x
        qkv_cols = (H + 2 * KVH) * D
        pending = 0  # the MLP output not yet added to x (the next norm adds it), by address
        held: dict[str, torch.Tensor] = {}  # torch's outputs, alive while the C calls read them
        for w in self.layers:
            eps = ctypes.c_float(w.eps)
            (qkv_w, o_w, gu_w, down_w) = w.linears
            # (the first layer's norm adds nothing: its residual's flag as the per-op path's)
            lib.kvflow_rms_norm(
                x_p, pending or None, w.norm1, b["h"], T, R, C, eps, act if pending else 0, act
            )
            qkv = self._linear("h", qkv_w, "qkv", T, R, qkv_cols, C, held)
            lib.kvflow_rope_store(
                qkv, b["q"], cos_p, sin_p, slots_p, w.k_cache, w.v_cache,
                T, H, KVH, D, bs, act, *self.store_flags, 0, self.k_pairs,
            )  # fmt: skip
            failed = self.decode(
                b["q"], w.k_cache, w.v_cache, tables_p, lens_p, b["o"], act,
                T, H, KVH, D, bs, max_blocks, ctypes.c_float(w.scale), window,
            )  # fmt: skip
            if failed:
                raise RuntimeError(f"paged decode attention failed ({failed})")
            a = self._linear("o", o_w, "a", T, R, C, H * D, held)
            lib.kvflow_rms_norm(x_p, a, w.norm2, b["h"], T, R, C, eps, act, act)
            gu = self._linear("h", gu_w, "gu", T, R, 2 * inter, C, held)
            lib.kvflow_silu_mul(gu, b["act"], T, R, inter, act, act)
            pending = self._linear("act", down_w, "m", T, R, C, inter, held)
        x += (held["m"] if self._last_m_torch else self.buffers["m"])[:T]
        return x

    def _linear(
        self,
        x: str,
        call: _LinearCall,
        out: str,
        T: int,
        R: int,
        N: int,
        K: int,
        held: dict[str, torch.Tensor],
    ) -> int:
        """Buffer x's rows through one linear layer -> the address of its [T, N] output:
        buffer `out`'s rows, or, where torch computed it, a new tensor's (held[out] until the
        next torch output of the same name replaces it)."""
        b = self._ptr
        if call.kind == "torch":
            assert call.weight is not None
            rows = self.buffers[x][: R if call.pads else T]  # [R or T, K]
            y: torch.Tensor
            if call.packed:
                y = torch.ops.mkldnn._linear_pointwise(rows, call.weight, call.bias, "none", [], "")
            else:
                y = F.linear(rows, call.weight, call.bias)
            held[out] = y  # [R or T, N]
            return y.data_ptr()
        w, scale, bias = call.ptrs
        if call.kind == "int16":
            xq = self.scratch.data_ptr()
            status = self.lib.kvflow_linear_i16(
                b[x], xq, xq + self._xq_bytes, w, scale, bias or None, b[out], T, N, K
            )
        else:
            status = self.lib.kvflow_matmul_rows_bf16(b[x], w, b[out], T, T, N, K)
        if status:
            raise RuntimeError(
                f"a linear layer's kernel refused [{T}, {K}] x [{N}, {K}] ({status})"
            )
        return b[out]
