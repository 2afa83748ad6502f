"""Decode attention alone: the C kernel reading blocks in place against the block gather.

    python ops/bench/attention.py                    # 64 sequences, contexts 100-450
    python ops/bench/attention.py --threads 1 --seqs 32

One layer's decode attention of the default model's shape (9 query heads over 3 KV
heads, head size 64, blocks of 16) over random float32 caches with scrambled block
tables, both paths in the same process, alternating; prints the median ms per layer
of each and their ratio, and checks that both give the same output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    InPlaceDecode,
    Workspace,
    decode_mask,
    paged_attention,
)
from worker.model.native import load_native


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-context", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=450)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_native()
    if loaded.kernels is None:
        sys.exit(f"the C kernel is not available: {loaded.reason}")
    n, heads, kvh, dim, bs = args.seqs, 9, 3, 64, 16
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.min_context, args.max_context + 1, (n,), generator=g)
    max_blocks = int(-(-lens.max() // bs))
    num_blocks = n * max_blocks + 16
    k_cache = torch.randn(num_blocks, kvh, bs, dim, generator=g)
    v_cache = torch.randn(num_blocks, kvh, bs, dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks)
    q = torch.randn(n, heads, dim, generator=g)
    rows = (tables[:, None, :] * kvh + torch.arange(kvh)[None, :, None]).reshape(-1)
    empty = torch.empty(0, dtype=torch.int64)
    no_kv = torch.empty(0, kvh, dim)

    def meta(in_place: InPlaceDecode | None, groups: list[DecodeGroup]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=empty,
            slot_blocks=empty,
            slot_offsets=empty,
            decode_groups=groups,
            prefills=[],
            in_place=in_place,
            block_size=bs,
            workspace=Workspace(torch.device("cpu")),
        )

    paths = {
        "in place (C kernel)": meta(
            InPlaceDecode(loaded.kernels, tables.to(torch.int32), lens.to(torch.int32), 0), []
        ),
        "block gather (torch)": meta(
            None, [DecodeGroup(0, n, rows, max_blocks, decode_mask(lens, max_blocks * bs, None))]
        ),
    }
    outs = [
        paged_attention(q, no_kv, no_kv, k_cache, v_cache, m, dim**-0.5) for m in paths.values()
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, m in paths.items():
            t0 = time.perf_counter()
            for _ in range(10):
                paged_attention(q, no_kv, no_kv, k_cache, v_cache, m, dim**-0.5)
            times[name].append((time.perf_counter() - t0) / 10 * 1000)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{n} sequences, contexts {int(lens.min())}-{int(lens.max())}, {torch.get_num_threads()} threads"
    )
    print("| path | ms per layer (median) |\n|---|---:|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.2f} |")
    first, second = med.values()
    print(f"gather / in place: {second / first:.2f}x")


if __name__ == "__main__":
    main()
