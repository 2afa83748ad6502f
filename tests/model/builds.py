"""The C kernels in each build this CPU runs: its own ("native", what the engine loads)
and the older instruction sets below it, whose code paths (AVX2 and FMA without AVX-512;
the plain loops) the CPUs that lack this one's extensions take. Without these builds an
AVX-512 machine would never compile or check the paths of an AVX2-only one."""

from __future__ import annotations

from worker.hardware import read_cpu_flags
from worker.model.native import NativeKernels, load_native


def kernel_builds(*, needs_avx2: bool = False) -> list[str]:
    """The -march targets to test on this CPU: "native", then "x86-64-v3" (AVX2 and FMA)
    where native adds AVX-512 to it, then "x86-64-v2" (no AVX2: the plain loops) where
    native has AVX2; `needs_avx2` leaves out the last (kernels it does not build)."""
    flags = read_cpu_flags()
    builds = ["native"]
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        builds.append("x86-64-v3")
    if "avx2" in flags and not needs_avx2:
        builds.append("x86-64-v2")
    return builds


def load_build(march: str) -> NativeKernels:
    loaded = load_native(march=march)
    assert loaded.kernels is not None, loaded.reason  # the test machines have a C compiler
    return loaded.kernels
