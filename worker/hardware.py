"""What the machine offers the engine: native bfloat16 or not, and how many cores.

`--dtype auto` (the default) resolves here, once at start-up: bfloat16 where the CPU
multiplies it faster than float32 (AMX, or AVX-512 BF16 other than on an Intel core
without AMX: `fast_bf16`; on an AMD EPYC torch's bf16 matmul ran ~3.5x its float32) or
on a CUDA device with bf16 support, float32 elsewhere (a CPU that emulates bf16 ran the
engine ~0.6x as fast as float32). Int8 linear layers (worker.model.quant) would be next
where the CPU has integer dot products, but they miss the accuracy bar
(`INT8_AGREEMENT`), so auto leaves them to `--dtype int8`. Where auto chose float32 on a
CPU whose widest vectors are AVX2, or one with AVX-512 VNNI, the linear layers compute
as 16-bit integer products (`choose_int16_linear`). The decision functions take the
facts as arguments, so tests can ask about any machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# CPU flags (as /proc/cpuinfo spells them) that mean bfloat16 matmuls run natively.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
INTEL = "GenuineIntel"  # /proc/cpuinfo's vendor_id
# Integer dot-product instructions: uint8 x int8 products summed straight into 32 bits.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")

# Auto takes a narrower dtype only if, under teacher forcing over float32's greedy
# continuations, it picks float32's next token at this share of positions or more.
AGREEMENT_BAR = 0.99
# Int8 linear layers' share on the default model (tests/model/test_default_model.py,
# 5 prompts x 64 tokens, prefill): 288 of 320. Weight rounding alone gave 311 of 320,
# per-row 8-bit activations alone 300: the model is too small to take both and hold
# 99%. Under the bar, so auto never picks int8; the test fails if the figure moves
# across the bar, so this constant and auto's choice follow the measurement.
INT8_AGREEMENT = 288 / 320


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the weights, activations and KV cache use, and why (for the start-up log)."""

    dtype: str
    reason: str


def fast_bf16(cpu_flags: frozenset[str], cpu_vendor: str) -> list[str]:
    """The flags by which this CPU multiplies bfloat16 faster than float32 (empty: it
    does not): AMX anywhere; avx512_bf16 except on Intel's cores without AMX. There
    vdpbf16ps issues at half the rate of a float32 FMA, so it does no more products a
    cycle: on an Intel Xeon (family 6 model 207) whose VM showed avx512_bf16 but hid AMX,
    torch's bfloat16 matmul ran at 0.72-0.82x float32's FLOP/s (64 and 256 rows of 576
    against 1,536 columns, 2 threads) and a batch-64 decode step of the default model took
    162.9 ms in bfloat16 against 70.9 ms with the int16 layers that auto takes without it
    (`ops/bench/step_profile.py`, one session). On AMD EPYC Zen 4 and Zen 5 bfloat16 ran
    ~3.5x float32."""
    if "amx_bf16" in cpu_flags:
        return [f for f in NATIVE_BF16_FLAGS if f in cpu_flags]
    if "avx512_bf16" in cpu_flags and cpu_vendor != INTEL:
        return ["avx512_bf16"]
    return []


def choose_dtype(
    requested: str,
    device: str,
    cpu_flags: frozenset[str],
    cuda_bf16: bool = False,
    int8_agreement: float = INT8_AGREEMENT,
    cpu_vendor: str = "",
) -> DtypeChoice:
    """Resolve `requested` ("auto" or a dtype name) for `device` given the hardware facts
    (`cpu_vendor`: /proc/cpuinfo's vendor_id).

    On CPU: bfloat16 where it is faster than float32 (`fast_bf16`); else int8 where the
    CPU has integer dot products and int8's measured agreement clears AGREEMENT_BAR; else
    float32.
    """
    if requested != "auto":
        return DtypeChoice(requested, "set explicitly")
    if device != "cpu":
        if cuda_bf16:
            return DtypeChoice("bfloat16", "auto: the CUDA device supports bfloat16")
        return DtypeChoice("float16", "auto: the CUDA device lacks bfloat16")
    native = fast_bf16(cpu_flags, cpu_vendor)
    if native:
        return DtypeChoice("bfloat16", f"auto: the CPU has native bfloat16 ({', '.join(native)})")
    if "avx512_bf16" in cpu_flags:
        no_bf16 = (
            "the CPU has avx512_bf16 but no AMX, an Intel core where bfloat16 does no more "
            "products a cycle than float32"
        )
    else:
        no_bf16 = "the CPU has no native bfloat16 (no avx512_bf16 / amx_bf16)"
    dot = [f for f in INT8_DOT_FLAGS if f in cpu_flags]
    if not dot:
        return DtypeChoice("float32", f"auto: {no_bf16} nor integer dot products for int8")
    agreement = f"int8 agreed with float32 on {int8_agreement:.1%} of next tokens"
    if int8_agreement >= AGREEMENT_BAR:
        return DtypeChoice("int8", f"auto: {no_bf16}; it has {', '.join(dot)} and {agreement}")
    return DtypeChoice(
        "float32",
        f"auto: {no_bf16}; {agreement}, under the {AGREEMENT_BAR:.0%} bar (--dtype int8 "
        "takes it anyway)",
    )


def choose_int16_linear(
    requested: str,
    auto_dtype: bool,
    linear_dtype: str,
    cpu_flags: frozenset[str],
    lanes: int,
) -> DtypeChoice | None:
    """Whether float32 linear layers compute as 16-bit integer products (worker/model/
    kernels/int16_matmul.c: 14-bit weights per output column, 13-bit inputs per block of
    64, exact int32 sums), given `--linear` (`requested`), whether `--dtype auto` chose
    the layers' dtype (`auto_dtype`) and that dtype, the CPU, and the kernel's build:
    `lanes` 16 (AVX-512 VNNI) or 8 (AVX2) where the kernel, the C layer ops it runs in
    and layers it takes are there, else 0. None: the layers keep float32 arithmetic.

    "int16" asks for it (ValueError where it cannot be had). Auto takes it for float32
    layers that auto chose (an explicit float32 stays exact: the reference the others are
    held to) on a CPU whose widest vectors are AVX2: there vpmaddwd does twice the products
    of an FMA per instruction, and a decoder layer's matmuls took 0.44-0.71x the time of
    float32 through oneDNN at 1-512 rows (AMD EPYC Zen 3, 2 threads); and on one with
    AVX-512 VNNI where the library was built with that kernel (vpdpwssd: twice the
    products of a 512-bit FMA; 0.36-0.55x oneDNN's float32 time at 1-512 rows on an Intel
    Xeon). With AVX-512 the AVX2 build is not taken: there it took 1.08-1.78x oneDNN's
    float32 time from 32 rows up (the same Xeon, two runs)."""
    if requested == "int16":
        if linear_dtype != "float32":
            raise ValueError(
                f"linear 'int16' computes float32 linear layers; this model's are {linear_dtype}"
            )
        if not lanes:
            raise ValueError(
                "linear 'int16' is not available: it needs the C kernels built for a CPU "
                "with AVX2 and FMA, the C layer ops (attention 'native' or 'auto'; not for "
                "models with a q/k norm) and linear layers of a multiple of 8 outputs (16 "
                "where the kernels are built with AVX-512 VNNI) and an even number of inputs"
            )
        return DtypeChoice("int16", "int16 set explicitly")
    if requested != "auto" or linear_dtype != "float32" or not lanes:
        return None
    if not auto_dtype or "avx2" not in cpu_flags:
        return None
    if lanes == 16:
        return DtypeChoice(
            "int16", "auto: float32 layers chosen by auto on a CPU with AVX-512 VNNI"
        )
    if "avx512f" in cpu_flags:
        return None
    return DtypeChoice(
        "int16", "auto: float32 layers chosen by auto on a CPU with AVX2 and no AVX-512"
    )


def choose_output_head(requested: str, linear: str, device: str) -> DtypeChoice:
    """The dtype of the output projection's narrow copy (`LlamaForCausalLM.
    narrow_output_projection`: the best candidates of each row are scored again in
    float32, so greedy picks stay float32's), given the requested and resolved dtypes of
    the linear layers. Bfloat16 and int8 linear layers take a copy in their own dtype.
    Float32 ones chosen by auto (a CPU without native bfloat16) take an int8 copy: the
    float32 projection (49,152 x 576) took 66 ms of a batch-64 decode step on an AMD
    EPYC with AVX2 only, the int8 one with its candidates re-scored 25 ms. An explicit
    float32 keeps the exact float32 projection (the reference the others are held to)."""
    if device != "cpu":
        return DtypeChoice(linear, "the model's dtype")
    if linear == "float32" and requested == "auto":
        return DtypeChoice(
            "int8", "auto: int8 candidates re-scored in float32 (float32 linear layers)"
        )
    if linear == "float32":
        return DtypeChoice("float32", "float32 set explicitly: one exact float32 projection")
    return DtypeChoice(linear, f"{linear} candidates re-scored in float32")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "bfloat16-int8")


def choose_kv_dtype(
    requested: str,
    device: str,
    activation_dtype: str,
    linear_dtype: str | None = None,
    in_place_decode: bool = False,
    cpu_flags: frozenset[str] = frozenset(),
    prompts_read_cache: bool = False,
) -> DtypeChoice:
    """The KV cache's dtype. On CUDA the model's. On CPU a bfloat16 cache holds half the
    bytes per block, so twice the blocks in the same memory, each value rounded as it is
    stored and widened to float32 where it is read; "auto" takes it where the linear
    layers are narrower than float32 (`linear_dtype` bfloat16, where the CPU multiplies
    bfloat16 natively, or "int16", float32 layers as 16-bit integer products) and decode
    attention reads the cache in place with the C kernel, float32 (the activations')
    elsewhere.
    Measured side by side, 64 sequences of 100-450 tokens: the kernel took 0.52-0.57x
    float32's time on a bfloat16 cache on an AMD EPYC (it is bound by reading the cache
    there) and about the same time on an Intel Xeon with AMX; the default model's greedy
    pick through a bfloat16 cache agreed with float32's at 320 of 320 positions. Behind
    float32 layers (an AMD EPYC with AVX2 only) it is not taken: there a batch-64 decode
    step's attention took 48-50 ms against float32's 59-71, yet the long-tail workload ran
    slower end to end (77.0 against 81.9 output tok/s, medians of 4 alternating runs of
    `ops/bench/engine.py --workload longtail`), greedy agreement 1023 of 1024. Behind
    int16 layers it is: on the Intel Xeon with AVX-512 VNNI and no bfloat16 a batch-64
    decode step took 76-79 ms against 93-94 (attention 24-25 ms against 38-39) and the
    long-tail workload ran at 243.9 against 232.3 output tok/s (medians of 4 alternating
    runs, every bfloat16 run ahead of its float32 pair); on the AMD EPYC with AVX2 only
    150.8 against 147.3, within the noise, and decode steps 0.85x / 0.86x / 0.89x
    float32's time at batch 64 / 32 / 16 (contexts of 256, both caches alternating step
    by step); greedy agreement through decode 1022 of 1024 with either cache, and twice
    the blocks.

    "bfloat16-int8" keeps the keys in bfloat16 and rounds the values alone to int8 rows,
    each with its float32 scale (worker.model.attention.quantize_rows): 196 bytes a head
    and token against 256 (1.31x the blocks). The keys are what int8 costs agreement: rows
    of a bfloat16 cache rounded through int8 after each step, 32 prompts x 64 positions,
    gave 2017 of 2048 with the keys rounded, 2034 with the values (bfloat16 2032); this
    cache itself 2030. `auto` takes it behind bfloat16 linear layers on a CPU with AMX,
    where prompts are attended by bfloat16 SDPA on their exact K/V, and decode attention
    reads the cache in place: batch-64 decode steps (contexts of 256) took 0.86x / 0.94x
    bfloat16's time, attention 17.0 against 20.3-20.7 ms (Intel Xeon with AMX, two
    alternating runs of `ops/bench/step_profile.py --batches 16,64 --kv-cache-dtype`):
    decode attention reads the cache at about the memory's pace there, so fewer bytes are
    less time.

    "int8" rounds the values so too and the keys by groups of 16 values, each group with
    its own scale (a key's few large channels no longer flatten the rest of its row): 148
    bytes a head and token (1.73x bfloat16's blocks). Simulated as above over int8 values,
    keys by groups of 64 (a row) gave 2016 of 2048, of 32 2025, of 16 2032, of 8 2032;
    the cache itself 2029, over the 99% bar (with one scale per key row it had been 2012;
    where the head size is not a multiple of 16 a key row still keeps one scale). `auto`
    does not take it: agreement this near the bar moves with any change to the arithmetic
    (SiLU computed with 512-bit vectors, 66 of 3.1M of its outputs one bfloat16 step
    apart, moved it to 2022, bfloat16 keys to 2033, the bfloat16 cache to 2028), and the
    job does not run faster for it. Behind bfloat16 layers on a CPU with AMX, against
    bfloat16 keys, batch-64 decode steps took 0.93x / 1.00x the time at contexts of 256
    (attention 16.7-16.8 against 18.6-19.4 ms), 0.89x / 0.98x at 512, 0.95x / 0.98x at
    1,024 (attention 0.86-0.95x), batch-16 steps 0.93x-0.99x; the long-tail workload ran
    the same (medians of four alternating runs, 508.6 output tok/s with int8, 513.5 with
    bfloat16 keys: its decode steps of 33+ sequences are a fifth of its time). The kernel
    reads its keys at less than the memory's pace (dequantizing 16 values takes a
    conversion and a product where a bfloat16 run takes a shift), so the bytes saved are
    not all time saved.

    Auto takes neither int8 cache where prompts are asked to be attended from the cache
    (`prompts_read_cache`: prefill attention "flash", whose C prompt kernel reads float32
    or bfloat16 caches only, or "native", which would hand prompt rows the rounded values:
    unmeasured), nor on the CPUs whose prompts take the C kernels (AVX2, or avx512_bf16
    without AMX: unmeasured there)."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {requested!r}")
    if device != "cpu":
        if requested not in ("auto", activation_dtype):
            raise ValueError(
                f"on {device} the KV cache takes the model's dtype ({activation_dtype})"
            )
        return DtypeChoice(activation_dtype, "the model's dtype")
    if requested != "auto":
        return DtypeChoice(requested, "set explicitly")
    amx = linear_dtype == "bfloat16" and "amx_bf16" in cpu_flags
    if amx and in_place_decode and not prompts_read_cache:
        return DtypeChoice(
            "bfloat16-int8",
            "auto: bfloat16 linear layers, AMX and in-place decode attention; values as "
            "int8, keys as bfloat16",
        )
    if linear_dtype in ("bfloat16", "int16") and in_place_decode:
        return DtypeChoice(
            "bfloat16", f"auto: {linear_dtype} linear layers and in-place decode attention"
        )
    return DtypeChoice(activation_dtype, "auto: the activations' dtype")


KEY_LAYOUTS = ("auto", "rows", "pairs")


def choose_key_layout(
    requested: str,
    device: str,
    kv_dtype: str,
    in_place_decode: bool,
    prefill_attention: str,
    cpu_flags: frozenset[str],
    group: int,
    block_size: int,
    prompt_pairs: bool = False,
) -> DtypeChoice:
    """How a block of the keys' cache is laid out on CPU: "rows" ([block_size, D] a KV
    head, a key's values together), or "pairs" ([D / 2, block_size, 2]: dimensions 2p and
    2p + 1 of the block's keys side by side). With pairs the C decode kernel loads 16 keys'
    values of two dimensions as one vector, widens it once for the G query heads of the KV
    head and adds each head's broadcast dimension into 16 lanes that are the 16 keys' dot
    products: no widened copy of the keys and no transpose tree summing lanes (`sum16`).
    The scores are float32 products of q as it is, summed in another order than the rows'.

    Pairs need bfloat16 keys ("bfloat16" or "bfloat16-int8"), decode attention in place
    (the C kernel) and prompts not attended by the C prompt kernel ("flash"), unless it
    takes pairs here (`prompt_pairs`: kernels/prefill_pairs.c built, a bfloat16 cache, the
    model's shapes); torch's gather paths put pairs back into rows where they read the cache (a
    prompt continuing a cached prefix, under SDPA). Auto takes them wherever the kernel's
    vector path takes the shape: AVX-512, blocks of a multiple of 16 keys, at most 8 query
    heads a KV head. Measured on two CPUs (`ops/bench/step_profile.py --batches 16,64
    --key-layout`, both layouts alternating):
    - an Intel Xeon with AMX (rows there: keys widened into a float32 copy, then FMAs):
      the decode kernel alone (64 sequences of 216-295 tokens, 30 layers' caches, blocks
      scattered) 0.87-0.89x the rows' time over int8 values, 0.88x over bfloat16 ones,
      0.78-0.81x with the caches hot; batch-64 steps 0.91-0.97x, batch-16 0.92-0.96x;
    - an AMD EPYC Zen 4 (rows there: `vdpbf16ps` and the transpose tree): batch-64
      attention 15.6-16.3 against 18.2-18.6 ms, steps 0.95-0.97x; batch-16 attention
      4.2-4.3 against 4.7-4.9 ms.
    Every other AVX-512 CPU's rows take one of these two paths, hence pairs there too
    where its prompts are not attended by "flash" (the Zen 5, unmeasured; the Intel Xeons
    without AMX take "flash", so rows). Where the vector path does not
    take the shape, its per-key loop took 2-3x the rows' time (16 query heads a KV head,
    or blocks of 8 keys, on the Xeon with AMX): rows. Asked for explicitly, pairs run at
    any shape."""
    if requested not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {requested!r}")
    why_not = None
    if device != "cpu":
        why_not = f"on {device} the keys are rows"
    elif kv_dtype not in ("bfloat16", "bfloat16-int8"):
        why_not = f"keys in pairs are bfloat16 (the KV cache is {kv_dtype})"
    elif not in_place_decode:
        why_not = "keys in pairs are read by the C decode kernel, which this engine lacks"
    elif prefill_attention == "flash" and not prompt_pairs:
        why_not = "the C prompt kernel (prefill attention flash) reads key rows here"
    if requested == "rows":
        return DtypeChoice("rows", "set explicitly")
    if requested == "pairs":
        if why_not is not None:
            raise ValueError(f"key_layout 'pairs' is not possible here: {why_not}")
        return DtypeChoice("pairs", "set explicitly")
    if why_not is not None:
        return DtypeChoice("rows", f"auto: {why_not}")
    if block_size % 16 or group > 8 or "avx512f" not in cpu_flags:
        return DtypeChoice(
            "rows",
            f"auto: the kernel scores pairs 16 keys a vector only with AVX-512, blocks of a "
            f"multiple of 16 keys and at most 8 query heads a KV head (here {group} over "
            f"blocks of {block_size})",
        )
    return DtypeChoice(
        "pairs", "auto: bfloat16 keys read in place, scored 16 keys a vector by AVX-512"
    )


PREFILL_ATTENTION_DTYPES = ("auto", "float32", "bfloat16", "native", "flash")


def choose_prefill_attention(
    requested: str,
    device: str,
    linear_dtype: str,
    cpu_flags: frozenset[str],
    in_place: bool = False,
    kv_dtype: str = "bfloat16",
    prompt_kernel: bool = False,
    prompt_pairs: bool = False,
    key_layout: str = "auto",
) -> DtypeChoice:
    """How prefill attention runs on CPU: torch's SDPA over a chunk and its cached context
    in float32 or on bfloat16 copies of q, k and v ("float32", "bfloat16"), the C decode
    kernel reading the cache in place, one query row at a time over the keys up to its
    own position ("native"; `in_place`: the runner has that kernel), or the C prompt
    kernel reading the cache in place, tiles of a chunk's queries against chunks of keys
    with flash attention's online softmax, in float32 ("flash"; `prompt_kernel`: the
    runner has it, for a float32 or bfloat16 cache, the model's head shapes and no
    sliding window; `prompt_pairs`: it also takes this model's keys in pairs, on bfloat16
    products, kernels/prefill_pairs.c). Outputs come back to the float32 residual stream
    either way.
    `linear_dtype` is the linear layers' ("int16" where float32 layers compute as integer
    products).

    "auto" takes "flash" over keys in pairs behind bfloat16 linear layers over a bfloat16
    cache where the CPU has avx512_bf16 but no AMX, the prompt kernel takes pairs and the
    keys are not asked to be rows (`key_layout`, the requested one; `choose_key_layout`
    then takes pairs): the runner sends it the chunks of enough attention work and the
    shorter ones to the decode kernel's rows (model_runner.PROMPT_KERNEL_MIN_WORK). On an
    AMD EPYC Zen 4 a prompt's attention over one layer's cache took 0.49-0.58x the decode
    kernel's rows' time at 2,048 tokens, 0.51-0.69x at 100-256 (q [T, 9, 64], blocks
    scattered, 2 threads; the rows' float32 products against bfloat16 ones); whole
    prompt steps 0.79x at 1 x 2,048 tokens, 0.88x at 2 x 1,024, 0.96-1.01x at 32 x 32 to
    8 x 256 (the rows' own path there). Else it takes "native" behind bfloat16 linear layers over a bfloat16 cache (`kv_dtype`:
    what was measured; an int8 cache would hand prompt rows its rounded K/V where SDPA
    takes the exact ones) where the CPU has avx512_bf16 but no AMX: one layer's prefill
    attention ran in 0.36-0.60x float32 SDPA's time and whole prefill steps in
    0.75-0.87x (8 prompts of 256, 16 of 128, 4 of 512, one of 2,048 tokens; AMD EPYC Zen
    5, 2 threads, alternating), where bfloat16 SDPA ran 1.05-1.12x float32's. Where the CPU has AMX it
    takes bfloat16 SDPA: 0.41-0.49x float32's time at 256-2,048 tokens, casts included,
    and 8 prompts of 512 prefilled in 0.74x the time (Intel Xeon with AMX, alternating);
    the kernel was not measured there. On a CPU with AVX2 and no AVX-512 it takes "flash":
    on an AMD EPYC with AVX2 only one layer's attention of a prompt of 64-512 tokens took
    0.56-0.73x float32 SDPA's time, 128 or 512 behind as many cached ones 0.70-0.80x, 1,024
    tokens 0.86x (a bfloat16 or float32 cache, alternating; SDPA without the gather of the
    context that the engine adds). Before its value tile kept its accumulators in
    registers, prompt steps of 4 x 256 and 8 x 256 (behind a cached 128) tokens took 0.95x
    and 0.93x, one of 1,024 1.00x, and the long-tail workload ran at 125.7 against 121.9
    output tok/s (medians of 4 alternating runs: within the noise); the decode
    kernel's rows had run prompt steps in 0.99-1.01x SDPA's time. With AVX-512 it takes
    "flash" behind int16 linear layers (`linear_dtype` "int16": float32 layers as integer
    products) over a bfloat16 cache: on an Intel Xeon (family 6 model 207, AVX-512, no
    AMX), with the kernel's tiles still 256-bit there, whole prompt steps took 0.87-1.02x
    float32 SDPA's time (8 x 256, 16 x 128, 1 x 256, 2 x 512, 1 x 1,024, 4 x 256 behind 128
    cached; two runs of `step_profile.py --compare-prefill`) and the long-tail workload ran
    at 304.4 against 277.9 output tok/s (medians of 3 alternating runs, each kernel run
    ahead of its pair); its AVX-512 tiles since took 0.71-0.84x the kernel's time.
    Elsewhere (float32 layers on AVX-512, unmeasured) float32 SDPA. On CUDA attention
    runs in the model's dtype."""
    if requested not in PREFILL_ATTENTION_DTYPES:
        raise ValueError(
            f"prefill_attention must be one of {PREFILL_ATTENTION_DTYPES}, got {requested!r}"
        )
    if device != "cpu":
        if requested != "auto":
            raise ValueError(f"prefill_attention is a CPU setting; on {device} use 'auto'")
        return DtypeChoice(linear_dtype, "the model's dtype")
    if requested == "native" and not in_place:
        raise ValueError(
            "prefill_attention 'native' reads the cache through the C decode kernel, "
            "which this engine does not use (see its attention setting)"
        )
    if requested == "flash" and not prompt_kernel:
        raise ValueError(
            "prefill_attention 'flash' needs the C prompt kernel, which this engine cannot "
            "use (no C kernels, a cache other than float32 or bfloat16, head shapes its "
            "tiles do not hold, or a sliding window)"
        )
    if requested != "auto":
        return DtypeChoice(requested, "set explicitly")
    if linear_dtype == "bfloat16" and "amx_bf16" in cpu_flags:
        return DtypeChoice("bfloat16", "auto: AMX and bfloat16 linear layers")
    if (
        prompt_pairs
        and key_layout != "rows"
        and kv_dtype == linear_dtype == "bfloat16"
        and "avx512_bf16" in cpu_flags
    ):
        return DtypeChoice(
            "flash",
            "auto: avx512_bf16 without AMX, the C prompt kernel over keys in pairs for long "
            "chunks, the decode kernel's rows for short ones",
        )
    if in_place and kv_dtype == linear_dtype == "bfloat16" and "avx512_bf16" in cpu_flags:
        return DtypeChoice("native", "auto: avx512_bf16 without AMX, the C kernel in place")
    if prompt_kernel and {"avx2", "fma"} <= cpu_flags and "avx512f" not in cpu_flags:
        return DtypeChoice("flash", "auto: AVX2 without AVX-512, the C prompt kernel in place")
    if prompt_kernel and linear_dtype == "int16" and kv_dtype == "bfloat16":
        return DtypeChoice(
            "flash", "auto: int16 linear layers over a bfloat16 cache, the C prompt kernel in place"
        )
    return DtypeChoice("float32", "auto: the activations' dtype")


def int8_reduce_range(cpu_flags: frozenset[str]) -> bool:
    """Whether int8 linear layers quantize their inputs to 7 bits (worker.model.quant):
    only where the CPU lacks integer dot products and 8 bits could saturate."""
    return not any(f in cpu_flags for f in INT8_DOT_FLAGS)


def resolve_device(name: str) -> torch.device:
    """`name` as a torch.device with its index: "cuda" alone is the current CUDA device.
    Tensors made on "cuda" report "cuda:N", and a generator made on "cuda" keeps no index,
    so the two would compare unequal (the sampler refuses logits not on its device)."""
    import torch

    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return parse_cpu_flags(text)


def read_cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor_id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"; empty where
    it cannot be read)."""
    try:
        return parse_cpu_vendor(cpuinfo.read_text())
    except OSError:
        return ""


def parse_cpu_vendor(cpuinfo_text: str) -> str:
    """The `vendor_id` line of the first processor in /proc/cpuinfo text."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The `flags` line of the first processor in /proc/cpuinfo text."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cgroup_cpu_limit(cpu_max_text: str) -> float | None:
    """Cores allowed by a cgroup v2 `cpu.max` ("quota period" or "max period"); None: no limit."""
    parts = cpu_max_text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cores(affinity: int, cgroup_limit: float | None) -> int:
    """Threads worth running: the CPUs this process may run on, capped by the cgroup quota."""
    cores = max(1, affinity)
    if cgroup_limit is not None:
        # A quota of 1.5 cores lets two threads run most of the time: round up.
        cores = min(cores, max(1, math.ceil(cgroup_limit)))
    return cores


def detect_cores() -> int:
    """available_cores() for this process: its affinity mask and its cgroup's cpu.max."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    affinity = affinity or (os.cpu_count() or 1)
    limit = None
    with contextlib.suppress(OSError):
        limit = cgroup_cpu_limit(Path("/sys/fs/cgroup/cpu.max").read_text())
    return available_cores(affinity, limit)


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advise_huge_pages(address: int, nbytes: int, setting: Path = THP_SETTING) -> bool:
    """Ask Linux to back [address, address + nbytes) with 2 MB pages where its pages are
    first touched (madvise MADV_HUGEPAGE over the whole huge pages inside the range).

    For the KV cache: decode attention reads each sequence's blocks (4 KB runs at the
    default model's shape) scattered over the cache, where every run on 4 KB pages is a
    TLB miss of its own; on an AMD EPYC with AVX2 only, where the kernel is bound by
    these reads, 2 MB pages took ~10% off its time. Only where the kernel's THP setting
    is `madvise` or `always` ([madvise] is what these machines run); False elsewhere,
    and where the range holds no whole huge page or the call fails.
    """
    try:
        chosen = setting.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    if chosen not in ("madvise", "always"):
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return bool(madvise(start, end - start, MADV_HUGEPAGE) == 0)


# glibc's mallopt parameters (malloc.h) and the environment variables that set them at
# process start, which win over the engine's choice.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
KEEP_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold
KEEP_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> str:
    """Let glibc keep the memory a CPU step frees, for the next step to reuse.

    A prompt step's temporaries (a layer's activations at 2,048 rows: tens of MB) come
    from the heap and go back to it; by default glibc returns the top of a heap to Linux
    once more than twice its moving mmap threshold is free, and the next layer faults
    the pages in again, zeroed. On an Intel Xeon, prompt steps of 8 x 256 tokens took
    17,000-280,000 minor faults each (up to ~1.1 GB), how many depending on the process,
    and ran 1.04-1.13x the time of steps with 0-10 faults. Fixed thresholds (allocations
    up to 32 MB from the heap, returned only past 1 GB free at its top) remove them;
    memory held stays at a step's peak. Not where the environment already sets either
    one, or the C library is not glibc. Returns what was done, for the start-up log (""
    where nothing was)."""
    env = os.environ if environ is None else environ
    if any(k in env for k in MALLOC_ENV):
        return ""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return ""
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD) != 1:
        return ""
    if mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD) != 1:
        return ""
    return (
        f"glibc keeps freed step memory (heap up to {KEEP_MMAP_THRESHOLD >> 20} MB a block, "
        f"trimmed past {KEEP_TRIM_THRESHOLD >> 30} GB)"
    )
