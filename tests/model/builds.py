"""The C kernels in each build this CPU runs: its own ("native", what the engine loads)
and the older instruction sets below it, whose code paths (AVX-512 without bfloat16 or
VNNI; AVX2 and FMA without AVX-512; the plain loops) the CPUs that lack this one's
extensions take. Without these builds an AVX-512 machine would never compile or check
the paths of an AVX2-only one, nor a Zen 4 those of an Intel Xeon without bfloat16."""

from __future__ import annotations

import torch

from worker.hardware import read_cpu_flags
from worker.model.native import MARCH_FLAGS, NativeKernels, load_native

# Builds of this CPU's own instruction set with code paths it does not take by default:
# the AMX tiles emulated in C (amx.h), so that a CPU without AMX checks the tiles' code
# (the row kernel's, the decode kernel's score pass); on a CPU with AMX, the decode
# kernel's score pass on the real tiles, which the default build leaves off (unmeasured).
AMX_EMULATED = "native+amx-emulated"
AMX_SCORES = "native+amx-scores"
VARIANT_DEFINES = {
    "amx-emulated": ("-DKVFLOW_AMX_EMULATE",),
    "amx-scores": ("-DKVFLOW_AMX_SCORES=1",),
}


def kernel_builds(*, needs_avx2: bool = False, variants: bool = False) -> list[str]:
    """The -march targets to test on this CPU: "native", then each older x86-64 level it
    runs whose paths differ from native's: "x86-64-v4" (AVX-512 without bfloat16 or VNNI)
    where native adds those, "x86-64-v3" (AVX2 and FMA) where native has AVX-512,
    "x86-64-v2" (no AVX2: the plain loops) where native has AVX2; `needs_avx2` leaves out
    the last (kernels it does not build). `variants` adds AMX_SCORES on a CPU with AMX,
    AMX_EMULATED on another with AVX-512."""
    flags = read_cpu_flags()
    runs = {m for m, needs in MARCH_FLAGS.items() if needs <= flags}
    builds = ["native"]
    beyond_v4 = {"avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}
    if {"x86-64-v3", "x86-64-v4"} <= runs and flags & beyond_v4:
        builds.append("x86-64-v4")
    if "x86-64-v3" in runs and "avx512f" in flags:
        builds.append("x86-64-v3")
    if "x86-64-v2" in runs and "avx2" in flags and not needs_avx2:
        builds.append("x86-64-v2")
    if variants and "amx_bf16" in flags:
        builds.append(AMX_SCORES)
    elif variants and "avx512f" in flags:
        builds.append(AMX_EMULATED)
    return builds


def load_build(name: str) -> NativeKernels:
    """A build by its name in kernel_builds: a -march, or "native+" a variant."""
    march, _, variant = name.partition("+")
    loaded = load_native(march=march, defines=VARIANT_DEFINES[variant] if variant else ())
    assert loaded.kernels is not None, loaded.reason  # the test machines have a C compiler
    return loaded.kernels


def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs avx512bw, avx512vl and
    avx512dq, or avx_ne_convert: an AMD EPYC with AVX2 only has neither)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 64)
    except RuntimeError:
        return False
    return True


def scores_on_tiles(kernels: NativeKernels) -> bool:
    """Whether `kernels` is the build variant meant to score keys in pairs on AMX tiles
    (AMX_EMULATED, or AMX_SCORES on a CPU with AMX)."""
    variants = [b for b in kernel_builds(variants=True) if "+" in b]
    return any(load_build(v).path == kernels.path for v in variants)
