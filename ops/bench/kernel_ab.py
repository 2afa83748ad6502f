"""Two versions of the C kernels side by side in one process: before and after a change.

    python ops/bench/kernel_ab.py --base HEAD~1                # this tree against HEAD~1
    python ops/bench/kernel_ab.py --base 5853923 --head b53ad7b --ops int16 --rows 8,16,32
    python ops/bench/kernel_ab.py --base HEAD~1 --march x86-64-v3   # the AVX2 build
    python ops/bench/kernel_ab.py --base /tmp/edited --ops decode   # an edited copy

Builds worker/model/kernels of `--base` (a git revision, or a folder of kernel sources:
an edited copy of this tree's, say `cp -r worker/model/kernels /tmp/edited` with one
constant changed) and of `--head` (likewise, or by default this working tree), loads both
libraries, and times each kernel a step of the
default model calls, on random data of the model's shapes and in its amounts (30 layers'
weights and caches, so that they stream from memory as in a step, not from cache):

- int16: a decoder layer's four matmuls on int16 weights (the AVX2 or AVX-512 VNNI
  build's float32 layers), 30 layers a pass;
- rows: the same on bfloat16 weights through the row kernel (CPUs with avx512_bf16),
  up to 128 rows;
- decode: decode attention over a bfloat16 cache, contexts of 200-300 tokens, 30 layers
  a pass, the rows being the sequences; keys as rows or in pairs (`--key-layout`; by
  default as `auto` would take them on this CPU: pairs with AVX-512);
- prefill: prompt attention of 8 fresh prompts from a bfloat16 cache, 30 layers a pass,
  the rows being each prompt's tokens.

The two versions alternate pass by pass (drift hits both alike); medians of `--rounds`.
Each pair of outputs is compared: a kernel change meant to keep its results shows 0 in
the table's last column. Prints a table and writes .md, .json and a PNG of the time ratio
to `--out`. The Python side (weight layouts, argument checks) is this tree's: versions
whose C entry points or layouts differ cannot be compared this way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.engine.model_runner import cache_tensor
from worker.hardware import choose_key_layout, keep_freed_memory, read_cpu_flags
from worker.model.native import (
    KERNELS,
    NativeKernels,
    int16_layout,
    load_native,
    rows_layout,
)

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of a layer's matmuls
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's attention
DEFAULT_ROWS = {
    "int16": "1,4,8,16,32,64,256",
    "rows": "1,4,8,16,32,64,128",
    "decode": "8,32,64",
    "prefill": "64,256",
}
PROMPTS = 8  # prompts a prefill pass attends, each its own sequence
CONTEXT = (200, 300)  # the decode sequences' cached keys, least and most

# one pass of an op; its outputs appended to the list where one is given (else dropped,
# as a step drops a layer's once the next has run)
Pass = Callable[[NativeKernels, list[torch.Tensor] | None], None]


@dataclass(frozen=True)
class Case:
    op: str
    rows: int
    run: Pass
    gop: float  # work in a pass: 1e9 operations (0: not counted)


def kernels_at(rev: str, into: Path) -> Path:
    """worker/model/kernels as `rev` holds it, extracted under `into`; a folder of kernel
    sources as it is."""
    if Path(rev).is_dir():
        if not (Path(rev) / "paged_decode.c").exists():
            sys.exit(f"{rev}: a folder, but not of the kernels' sources (no paged_decode.c)")
        return Path(rev)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "worker/model/kernels"],
        capture_output=True,
    )
    if archive.returncode != 0:
        sys.exit(f"no kernels at revision {rev!r}: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "worker" / "model" / "kernels"


def load(kernels: Path, march: str, name: str) -> NativeKernels:
    try:
        loaded = load_native(march=march, kernels=kernels)
    except AttributeError as e:  # ctypes: an entry point this tree's loader sets up
        sys.exit(f"{name}: its kernels' entry points differ from this tree's ({e})")
    if loaded.kernels is None:
        sys.exit(f"{name}: {loaded.reason}")
    return loaded.kernels


def matmul_cases(op: str, ops: NativeKernels, rows: list[int], layers: int) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    flat = [torch.randn(n, k, generator=g) * 0.05 for _ in range(layers) for n, k in SHAPES]
    if op == "int16":
        i16 = [int16_layout(w, ops.int16_lanes) for w in flat]
        dtype = torch.float32

        def mm(k: NativeKernels, x: torch.Tensor, j: int) -> torch.Tensor:
            return k.linear_i16(x, i16[j])

    else:
        bf16 = [rows_layout(w) for w in flat]
        dtype = torch.bfloat16

        def mm(k: NativeKernels, x: torch.Tensor, j: int) -> torch.Tensor:
            return k.matmul_rows(x, bf16[j], x.shape[0])

    del flat
    cases = []
    for M in rows:
        xs = [torch.randn(M, k, generator=g).to(dtype) for _, k in SHAPES]

        def run(
            k: NativeKernels, keep: list[torch.Tensor] | None, xs: list[torch.Tensor] = xs
        ) -> None:
            for j in range(layers * len(SHAPES)):
                out = mm(k, xs[j % len(SHAPES)], j)
                if keep is not None:
                    keep.append(out)

        gop = 2 * M * layers * sum(n * k for n, k in SHAPES) / 1e9
        cases.append(Case(op, M, run, gop))
    return cases


def paged_caches(
    seqs: int, keys: int, layers: int, g: torch.Generator, key_pairs: bool = False
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`layers` layers' bfloat16 K and V caches [blocks, KVH, BS, D] (keys in pairs: [blocks,
    KVH, D / 2, BS, 2]) for `seqs` sequences of up to `keys` keys, and their block tables
    [seqs, blocks a sequence] int32: the blocks scattered, as a long-running cache holds
    them, allocated as the engine allocates its cache (`cache_tensor`: 2 MB pages where
    Linux gives them)."""
    per_seq = -(-keys // BLOCK)
    blocks = seqs * per_seq
    rows = (blocks, KV_HEADS, BLOCK, HEAD_DIM)
    pairs = (blocks, KV_HEADS, HEAD_DIM // 2, BLOCK, 2)

    def cache(shape: tuple[int, ...]) -> torch.Tensor:
        t = cache_tensor(shape, torch.bfloat16, torch.device("cpu"))
        return t.copy_(torch.randn(shape, generator=g))

    caches = [(cache(pairs if key_pairs else rows), cache(rows)) for _ in range(layers)]
    tables = torch.randperm(blocks, generator=g).to(torch.int32).view(seqs, per_seq)
    return caches, tables


def decode_cases(rows: list[int], layers: int, key_pairs: bool) -> list[Case]:
    g = torch.Generator().manual_seed(1)
    cases = []
    for n in rows:
        lens = torch.randint(CONTEXT[0], CONTEXT[1] + 1, (n,), generator=g, dtype=torch.int32)
        caches, tables = paged_caches(n, CONTEXT[1], layers, g, key_pairs)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g)

        def run(
            k: NativeKernels,
            keep: list[torch.Tensor] | None,
            q: torch.Tensor = q,
            caches: list[tuple[torch.Tensor, torch.Tensor]] = caches,
            tables: torch.Tensor = tables,
            lens: torch.Tensor = lens,
        ) -> None:
            for kc, vc in caches:
                out = torch.empty_like(q)
                k.paged_decode(q, kc, vc, tables, lens, out, HEAD_DIM**-0.5, 0)
                if keep is not None:
                    keep.append(out)

        cases.append(Case("decode", n, run, 0.0))
    return cases


def prefill_cases(rows: list[int], layers: int) -> list[Case]:
    g = torch.Generator().manual_seed(2)
    cases = []
    for T in rows:
        caches, tables = paged_caches(PROMPTS, T, layers, g)
        qs = torch.randn(PROMPTS, T, HEADS, HEAD_DIM, generator=g)

        def run(
            k: NativeKernels,
            keep: list[torch.Tensor] | None,
            qs: torch.Tensor = qs,
            caches: list[tuple[torch.Tensor, torch.Tensor]] = caches,
            tables: torch.Tensor = tables,
        ) -> None:
            for kc, vc in caches:
                for p in range(PROMPTS):
                    out = torch.empty_like(qs[p])
                    k.prefill_attention(qs[p], kc, vc, tables[p], 0, out, HEAD_DIM**-0.5)
                    if keep is not None:
                        keep.append(out)

        # causal: each of H heads' T x T / 2 scores and as many value products
        gop = PROMPTS * layers * HEADS * T * (T + 1) / 2 * HEAD_DIM * 4 / 1e9
        cases.append(Case("prefill", T, run, gop))
    return cases


def pass_ms(run: Pass, ops: NativeKernels, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        run(ops, None)
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", required=True, help="git revision (or folder) of the kernels before")
    ap.add_argument(
        "--head", default=None, help="git revision (or folder) after (default: this tree)"
    )
    ap.add_argument(
        "--key-layout",
        choices=("auto", "rows", "pairs"),
        default="auto",
        help="decode's keys (auto: as the engine's auto takes them on this CPU)",
    )
    ap.add_argument("--ops", default=None, help="int16,rows,decode,prefill (default: those built)")
    ap.add_argument("--rows", default=None, help="rows (sequences for decode) for every op")
    ap.add_argument("--march", default="native", help="the kernels' -march (default: this CPU)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-results/kernel-ab"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine does: a step's temporaries without page faults
    with tempfile.TemporaryDirectory() as tmp:
        base = load(kernels_at(args.base, Path(tmp) / "base"), args.march, args.base)
        head_name = args.head or "this tree"
        head_dir = kernels_at(args.head, Path(tmp) / "head") if args.head else KERNELS
        head = load(head_dir, args.march, head_name)
    built = [
        op
        for op, ok in (
            ("int16", head.int16_built),
            ("rows", head.matmul_rows_built),
            ("decode", True),
            ("prefill", True),
        )
        if ok
    ]
    ops = args.ops.split(",") if args.ops else built
    for op in ops:
        if op not in built:
            sys.exit(f"{op}: not in this CPU's {args.march} build (built here: {', '.join(built)})")
    # auto: the engine's own rule, for the default model's shape over a bfloat16 cache
    layout = choose_key_layout(
        args.key_layout, "cpu", "bfloat16", True, "native", read_cpu_flags(),
        HEADS // KV_HEADS, BLOCK,
    )  # fmt: skip
    key_pairs = layout.dtype == "pairs"
    cases: list[Case] = []
    for op in ops:
        rows = [int(r) for r in (args.rows or DEFAULT_ROWS[op]).split(",")]
        if op == "decode":
            cases += decode_cases(rows, args.layers, key_pairs)
        elif op == "prefill":
            cases += prefill_cases(rows, args.layers)
        else:
            cases += matmul_cases(op, head, rows, args.layers)
    results = []
    for case in tqdm(cases, desc="cases", file=sys.stderr):
        out_base: list[torch.Tensor] = []
        out_head: list[torch.Tensor] = []
        case.run(base, out_base), case.run(head, out_head)  # warm-up, and the outputs
        diff = max(
            float((a.float() - b.float()).abs().max())
            for a, b in zip(out_base, out_head, strict=True)
        )
        del out_base, out_head
        t0 = time.perf_counter()
        case.run(base, None)
        calls = max(1, round(0.2 / max(time.perf_counter() - t0, 1e-6)))  # ~0.2 s a round
        times: dict[str, list[float]] = {"base": [], "head": []}
        for _ in range(args.rounds):
            times["base"].append(pass_ms(case.run, base, calls))
            times["head"].append(pass_ms(case.run, head, calls))
        b_ms, h_ms = statistics.median(times["base"]), statistics.median(times["head"])
        results.append(
            {
                "op": case.op,
                "rows": case.rows,
                "base_ms": b_ms,
                "head_ms": h_ms,
                "ratio": h_ms / b_ms,
                "head_gops": case.gop / h_ms * 1e3 if case.gop else None,
                "max_abs_diff": diff,
            }
        )
    lines = [
        f"C kernels of {head_name} against {args.base} (-march={args.march}), "
        f"{args.threads} threads, {args.layers} layers a pass, medians of {args.rounds} "
        f"alternating rounds; decode's keys {'in pairs' if key_pairs else 'as rows'}",
        "",
        "| op | rows | base ms | head ms | head ÷ base | head GOP/s | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        gops = f"{r['head_gops']:.0f}" if r["head_gops"] else "-"
        lines.append(
            f"| {r['op']} | {r['rows']} | {r['base_ms']:.2f} | {r['head_ms']:.2f} | "
            f"{r['ratio']:.3f} | {gops} | {r['max_abs_diff']:.3g} |"
        )
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_ab.md").write_text(text + "\n")
    record = {
        "base": args.base,
        "head": head_name,
        "march": args.march,
        "key_layout": "pairs" if key_pairs else "rows",
        "results": results,
    }
    (args.out / "kernel_ab.json").write_text(json.dumps(record, indent=1))
    plot(results, f"{head_name} vs {args.base}", args.out / "kernel_ab.png")
    print(f"wrote {args.out}/kernel_ab.md, .json, .png")


def plot(results: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for op in dict.fromkeys(str(r["op"]) for r in results):
        mine = [r for r in results if r["op"] == op]
        ax.plot([r["rows"] for r in mine], [r["ratio"] for r in mine], marker="o", label=op)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (sequences for decode)")
    ax.set_ylabel("head time ÷ base time")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
