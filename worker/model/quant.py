"""Int8 linear layers: int8 weights, activations quantized per call (`--dtype int8`).

For CPUs without native bfloat16, where float32 matmuls bound the decode step. Each
weight row (output channel) gets its own symmetric scale, |w| max / 127; torch's
`quantized::linear_dynamic` (fbgemm) quantizes each call's input to uint8 with one
scale and zero point for the whole [T, in] matrix, multiplies in integers and returns
float32. On an Intel Xeon (1 thread, 64 rows) it ran the default model's layers 2.5-4x
as fast as float32's F.linear; the weight-only kernel (`aten._weight_int8pack_mm`)
ran 2x slower than float32 there and is not used.

One scale for the whole input fails on this model family: the first token's inputs to
some down projections reach ~3000 where other rows stay under ~5, and one step of
3000/127 wipes those rows out (the default model's next token agreed with float32's at
212 of 320 positions). Each row is divided by its own |x| max first and its result
multiplied back: per-row quantization through the same op. Two more input columns,
+1 and -1 against zero weights, pin the op's range to [-1, 1] whatever the rows hold,
so its input scale is always the same and a row's result is bitwise the same alone or
in any batch (integer products, summed exactly). Next-token agreement with float32
(teacher forcing, 320 positions): 288 pinned, 296 unpinned (the op then fits the range
of each batch, a little finer where every row's largest value has the same sign, but a
row's result depends on its neighbours), 280 with each row's own [min, max] mapped onto
[-1, 1]. Differences of this size are within what any small change of rounding moves.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

PIN = torch.tensor([1.0, -1.0])  # the two extra input columns: the op's range, [-1, 1]


class Int8Linear(nn.Module):
    """y = x @ w.T + b with w held as packed int8 (per-output-channel scales), x float32.

    `reduce_range` quantizes the input to 7 bits instead of 8. CPUs without integer
    dot-product instructions (VNNI) sum pairs of uint8 x int8 products in 16 bits, which
    can saturate at 8 bits; with VNNI the products go straight to 32 bits, and 8 bits
    halved the error (rms 0.025 -> 0.015 on a random 576 -> 1536 layer) and moved the
    default model's next-token agreement with float32 from 268 to 296 of 320 (unpinned): so False
    where the CPU has VNNI (`worker.hardware.int8_reduce_range`).
    """

    scale: torch.Tensor  # [out] the weights' per-row step
    bias: torch.Tensor | None  # [out] float32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # [out, in + 2]: the two pinning columns (see the module docstring) weigh nothing.
        w = F.pad(weight.detach().float(), (0, 2))
        self.reduce_range = reduce_range
        # A row of zeros would get scale 0 and divide by it; any positive scale is exact.
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [out]
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 warns that quantized tensors are deprecated; one is needed here,
            # once at load time, only to hand the weights to linear_prepack.
            warnings.filterwarnings(
                "ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel"
            )
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        self.register_buffer("scale", scale, persistent=False)
        # The bias is added after the rows are scaled back (see forward), so not packed.
        b = None if bias is None else bias.detach().float()
        self.register_buffer("bias", b, persistent=False)
        self.packed = torch.ops.quantized.linear_prepack(q, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] float32. Each row divided by its own |x| max, so the op's one input
        # scale fits every row; its result times the same max is the row's product.
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)  # [T, 1]
        xs = x.new_empty((x.shape[0], self.in_features + 2))  # [T, in + 2]
        torch.div(x, amax, out=xs[:, : self.in_features])
        xs[:, -2:] = PIN
        y = torch.ops.quantized.linear_dynamic(xs, self.packed, self.reduce_range)
        out: torch.Tensor = y.mul_(amax)  # [T, out]
        return out if self.bias is None else out.add_(self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weights as the kernel sees them (for tests and checks)."""
        w: torch.Tensor = self.packed.unpack()[0].dequantize()
        return w[:, : self.in_features]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, reduce_range={self.reduce_range}"
