"""The int16 matmul (worker/model/kernels/int16_matmul*.c) against float32 through oneDNN.

    python ops/bench/int16_kernel.py                    # rows 1 to 512, 2 threads
    python ops/bench/int16_kernel.py --rows 16,64 --out bench-results/int16
    python ops/bench/int16_kernel.py --march x86-64-v3   # the AVX2 build (AVX2 and FMA)

A decoder layer's four matmuls of the default model (qkv 960 x 576, o 576 x 576,
gate+up 3072 x 576, down 576 x 1536; random weights of the same shapes), the int16
kernel's calls (the inputs' rounding included) and oneDNN's float32 matmul on weights
packed for the row count, the two alternating in one process; medians of 9 rounds, each
a few hundred calls. Prints a table and writes JSON and a PNG of the time ratio.
`--march` times the kernels built for an older instruction set than this CPU's (the AVX2
build where this one has AVX-512 VNNI: its code, on this CPU's cores and memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.hardware import read_cpu_flags
from worker.model.native import int16_layout, load_native

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of each matmul


def round_ms(fn: Callable[[], None], calls: int) -> float:
    """ms per call over `calls` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--out", type=Path, default=None, help="default: bench-results/int16-kernel[-MARCH]"
    )
    ap.add_argument("--march", default="native", help="the kernels' -march (default: this CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_native(march=args.march)
    ops = loaded.kernels
    if ops is None or not ops.int16_built:
        sys.exit(f"no int16 kernel here ({loaded.reason})")
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    int16 = [int16_layout(w, ops.int16_lanes) for w in weights]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for M in tqdm(rows_list, desc="rows", file=sys.stderr):
        xs = [torch.randn(M, k) for _, k in SHAPES]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in weights]

        def f32(xs: list[torch.Tensor] = xs, packed: list[torch.Tensor] = packed) -> None:
            for x, p in zip(xs, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        def i16(xs: list[torch.Tensor] = xs) -> None:
            for x, w in zip(xs, int16, strict=True):
                ops.linear_i16(x, w)

        calls = max(3, 2000 // M)
        f32(), i16()  # warm-up
        t_f32, t_i16 = [], []
        for _ in range(args.rounds):  # alternating, so that drift hits both alike
            t_f32.append(round_ms(f32, calls))
            t_i16.append(round_ms(i16, calls))
        a, b = statistics.median(t_f32), statistics.median(t_i16)
        gop = 2 * M * sum(n * k for n, k in SHAPES) / 1e9
        results.append(
            {"rows": M, "float32_ms": a, "int16_ms": b, "ratio": b / a, "int16_gops": gop / b * 1e3}
        )
    flags = read_cpu_flags()
    isa = "AVX-512 VNNI" if ops.int16_lanes == 16 else "AVX2"
    lines = [
        f"int16 kernel ({isa} build, -march={args.march}, column blocks of {ops.int16_lanes}) "
        "against oneDNN "
        f"float32, {args.threads} threads; avx512_bf16: {'avx512_bf16' in flags}",
        "",
        "| rows | oneDNN float32 (ms) | int16 (ms) | int16 ÷ float32 | int16 GOP/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['float32_ms']:.3f} | {r['int16_ms']:.3f} | "
            f"{r['ratio']:.2f} | {r['int16_gops']:.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    out: Path = args.out or Path(
        "bench-results/int16-kernel" + ("" if args.march == "native" else f"-{args.march}")
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "int16_kernel.md").write_text(text + "\n")
    record = {"march": args.march, "lanes": ops.int16_lanes, "rows": results}
    (out / "int16_kernel.json").write_text(json.dumps(record, indent=1))
    plot(results, isa, out / "int16_kernel.png")
    print(f"wrote {out}/int16_kernel.md, .json, .png")


def plot(results: list[dict[str, float]], isa: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot([r["rows"] for r in results], [r["ratio"] for r in results], marker="o")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("int16 time ÷ float32 time")
    ax.set_title(f"A decoder layer's matmuls: int16 ({isa}) vs oneDNN float32", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
