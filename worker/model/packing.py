"""Linear-layer weights packed once for oneDNN on CPU.

torch's CPU matmul takes the weight in its plain [out, in] layout and copies it into the
kernel's blocked layout at every call. A decode step's matmuls have few rows, so that
copy is a large part of them: on an AMD EPYC with avx512_bf16 (2 threads, the default
model's 121 linear layers, weights streaming from memory) a pass took 0.59x / 0.79x /
0.96x the plain time in bfloat16 at 16 / 64 / 2048 rows with the weights packed once at
load, and 0.44x / 0.60x in float32 at 16 / 64 (where the plain matmul is MKL's).
bfloat16 results were bit for bit the plain matmul's there; float32 ones differ in
summation order only. Int8 layers keep torch's quantized kernels, which pack their own weights.
"""

from __future__ import annotations

import torch

from worker.model.llama import ROWS_KERNEL_MAX, Linear, LlamaForCausalLM
from worker.model.native import NativeKernels, int16_layout, rows_layout

# The row count oneDNN picks the blocked layout for: a full decode batch. Any row count
# runs on the packed weight.
PACK_ROWS = 64
PACKED_DTYPES = (torch.bfloat16, torch.float32)
# The C row kernel's copy of the weights (decoder and narrow head) is kept only up to
# this size: it doubles the memory those linear layers take.
ROWS_COPY_MAX_BYTES = 1 << 30


def pack_linear_layers(model: LlamaForCausalLM, choice: str, device_type: str) -> str:
    """Pack (or, for "torch", unpack) the decoder layers' float Linears and the output
    projection's narrow copy as `choice` says ("auto", "onednn" or "torch"); returns the
    path taken and why, for the start-up log. Raises ValueError when "onednn" was asked
    for and cannot be had. The full-precision projection stays plain: its rows are read
    one by one to re-score candidates, and a tied one is the embedding table.

    The weights are the model's: a runner built later on the same loaded model with
    another choice changes them under the earlier runner too (each keeps computing
    correctly, on the path the model now has; only its start-up description is stale)."""
    linears = _linears(model)

    def plain(why: str) -> str:
        for m in linears:  # also after a packing that failed halfway
            m.unpack()
        if choice == "onednn":
            raise ValueError(f"linear 'onednn' is not available: {why}")
        return f"torch ({why})"

    if choice == "torch":
        return plain("set explicitly")
    if device_type != "cpu":
        return plain(f"oneDNN packing is for CPU, not {device_type}")
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return plain("this torch build has no oneDNN")
    targets = [m for m in linears if m.weight.dtype in PACKED_DTYPES]
    if not targets:
        return plain("no bfloat16 or float32 linear layers")
    try:
        for m in targets:
            m.pack(PACK_ROWS)
    except RuntimeError as e:  # a torch build whose oneDNN lacks the op for this dtype
        return plain(f"packing failed: {e}")
    n = len(targets)
    return f"oneDNN, {n} weight{'s' if n > 1 else ''} packed at load"


def attach_rows_weights(model: LlamaForCausalLM, kernels: NativeKernels | None) -> str:
    """Give each of the decoder's bfloat16 Linears and the output projection's narrow copy
    (no bias, out a multiple of 16, in even) a copy of its weight in the layout of the C
    row kernel (`Linear.matmul`), where the kernel is built (a CPU with avx512_bf16; on
    AMX tiles where it has AMX) and the copies fit ROWS_COPY_MAX_BYTES; else drop any
    such copies. Returns what was done, for the start-up log. A second copy, not a view:
    oneDNN's packed weight is opaque outside oneDNN."""
    linears = _linears(model)
    for m in linears:
        m.rows_weight = None
    if kernels is None or not kernels.matmul_rows_built:
        return "no row kernel (it needs avx512_bf16 and the C layer ops)"
    targets = [
        m
        for m in linears
        if m.weight.dtype == torch.bfloat16
        and m.bias is None
        and m.weight.shape[0] % 16 == 0
        and m.weight.shape[1] % 2 == 0
    ]
    size = sum(m.weight.shape[0] * m.weight.shape[1] * 2 for m in targets)
    if not targets or size > ROWS_COPY_MAX_BYTES:
        why = "no bfloat16 layers it takes" if not targets else f"{size >> 20} MB of weights"
        return f"no row kernel ({why})"
    for m in targets:
        plain = m.weight.to_dense() if m.packed else m.weight
        m.rows_weight = rows_layout(plain)
    tiles = " on AMX tiles" if kernels.matmul_rows_amx else ""
    return (
        f"at <= {ROWS_KERNEL_MAX} rows the C row kernel{tiles}, over a second copy of "
        f"{len(targets)} weights ({size >> 20} MB)"
    )


def int16_fits(model: LlamaForCausalLM, lanes: int) -> bool:
    """Whether every Linear of the decoder is one the int16 kernel built with column blocks
    of `lanes` takes: float32, out a multiple of `lanes`, in even (all or none: a layer's
    rows are padded alike for its matmuls)."""
    decoder = _decoder_linears(model)
    return (
        lanes > 0
        and bool(decoder)
        and all(
            m.weight.dtype == torch.float32
            and m.weight.shape[0] % lanes == 0
            and m.weight.shape[1] % 2 == 0
            for m in decoder
        )
    )


def attach_int16_weights(model: LlamaForCausalLM, lanes: int) -> str:
    """With `lanes` (> 0, where `int16_fits`), give each of the decoder's Linears its weight
    rounded for 16-bit integer products (`Linear.matmul`, worker/model/kernels/
    int16_matmul.c) in column blocks of `lanes`, its float32 weight unpacked (the kernel
    takes any row count: no padding); with 0, drop any such copies. Returns what was done, for the start-up log.
    The float32 weights stay: the torch path (no C layer ops) still computes with them."""
    decoder = _decoder_linears(model)
    for m in decoder:
        m.int16_weight = None
    if not lanes:
        return ""
    if not int16_fits(model, lanes):
        raise ValueError(f"int16 weights need float32 layers of N % {lanes} == 0 and even K")
    size = 0
    for m in decoder:
        m.unpack()
        m.int16_weight = int16_layout(m.weight, lanes)
        size += m.int16_weight.nbytes
    return (
        f"{len(decoder)} float32 weights as 16-bit integer products in C (14-bit weights per "
        f"output column, inputs 13-bit per block of 64; a copy of {size >> 20} MB)"
    )


def _linears(model: LlamaForCausalLM) -> list[Linear]:
    """The decoder layers' Linears and the output projection's narrow copy where it is one."""
    linears = _decoder_linears(model)
    if isinstance(model.narrow_head, Linear):
        linears.append(model.narrow_head)
    return linears


def _decoder_linears(model: LlamaForCausalLM) -> list[Linear]:
    return [m for m in model.layers.modules() if isinstance(m, Linear)]
