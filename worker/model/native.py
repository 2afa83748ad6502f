"""CPU kernels in C, compiled on first use for the machine they run on.

The paged decode attention kernel (kernels/paged_decode.c) reads each sequence's keys
and values straight out of the cache blocks; torch has no CPU op for that, and the
torch path (gather the blocks into a scratch tensor, then two matmuls) copies every
sequence's whole context once per layer and step. The kernel is plain C with OpenMP,
built with the system's C compiler (`-march=native`: the build is keyed by the CPU's
flags as well as the source) into a cache directory and loaded with ctypes; where no
compiler is found or the build fails, the caller keeps the torch path and says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.hardware import read_cpu_flags

SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
LIBS = ("-lm",)  # libm with glibc's vector maths (the vectorised expf)
MAX_GROUP = 64  # query heads per KV head the kernel's per-pair arrays hold
KV_DTYPES = (torch.float32, torch.bfloat16)  # caches the kernel reads (q and out: float32)


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library; `paged_decode` wraps its one entry point."""

    lib: ctypes.CDLL
    path: Path

    def paged_decode(
        self,
        q: torch.Tensor,  # [n, H, D] float32, contiguous
        k_cache: torch.Tensor,  # [NB, KVH, BS, D] float32 or bfloat16
        v_cache: torch.Tensor,  # like k_cache
        block_tables: torch.Tensor,  # [n, max_blocks] int32
        context_lens: torch.Tensor,  # [n] int32
        out: torch.Tensor,  # [n, H, D] float32, contiguous
        scale: float,
        window: int,
    ) -> None:
        n, H, D = q.shape
        _, KVH, BS, _ = k_cache.shape
        if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
            raise TypeError(f"the C kernel reads a float32 or bfloat16 cache, not {k_cache.dtype}")
        entry = (
            self.lib.kvflow_paged_decode_bf16
            if k_cache.dtype == torch.bfloat16
            else (self.lib.kvflow_paged_decode_f32)
        )
        failed = entry(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
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
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch memory")


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


def load_native(compiler: str | None = None) -> NativeLoad:
    """Build (once per source, compiler and CPU) and load the CPU kernels."""
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return NativeLoad(None, f"no C compiler ({cc!r} not found)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(CFLAGS + LIBS).encode(),
                cc.encode(),
                " ".join(sorted(read_cpu_flags())).encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        try:
            _build(cc, target)
        except (OSError, subprocess.SubprocessError) as e:
            return NativeLoad(None, f"the C kernels did not build ({e})")
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        target.unlink(missing_ok=True)  # rebuilt next time rather than failing for ever
        return NativeLoad(None, f"the C kernels did not load ({e})")
    for fn in (lib.kvflow_paged_decode_f32, lib.kvflow_paged_decode_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return NativeLoad(NativeKernels(lib, target), f"C kernels built for this CPU ({target.name})")


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent builders never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, str(SOURCE), *LIBS],
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
