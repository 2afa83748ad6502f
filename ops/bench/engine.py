"""Engine benchmark: one workload through kvflow and its peers, side by side.

    python ops/bench/engine.py                       # all four systems, 128 requests
    python ops/bench/engine.py --systems kvflow-continuous,kvflow-static -n 64
    python ops/bench/engine.py --workload longtail --systems kvflow-continuous \
        --llama-server /tmp/llama/build/bin/llama-server --profile

Workloads (every request submitted at once, output length fixed per request with EOS
ignored, so every system does the same work):
  mixed     n requests (default 128); prompts of 16-512 tokens cut from real text, no
            shared prefixes; outputs lognormal, median 64, clipped to 8-512.
  longtail  64 requests; prompts up to 350 tokens, three in four opening with one of
            four shared preambles; outputs lognormal, median 32, clipped to 8-141
            (~3,000 tokens): a batch job's shape.
Systems:
  kvflow-continuous  this engine, iteration-level scheduling
  kvflow-gather      this engine, continuous, decode attention by block gather + matmuls
                     (--attention torch) instead of the C kernel reading blocks in place
  kvflow-static      this engine, request-level batching (batch runs to its longest member)
  hf-generate        transformers `generate` on static padded batches
  hf-generate-batch  transformers' continuous batching manager (`generate_batch`)
  llama-server       (with --llama-server PATH) llama.cpp's server, same GGUF, at slot
                     counts --llama-slots; its best slot count is its figure
With --llama-server, --rounds pairs follow the slot sweep: kvflow-continuous, then
llama-server at its best slot count, alternating, each run from a cold start (a new engine
with an empty prefix cache; a new server). A slow spell of the machine lasts minutes and
moves a single run by up to ~1.4x, while the sweep gives llama-server the best of five
runs: the pairs' ratio of medians is the comparison to quote.
Prints output tok/s and computed tok/s (prompt + output), TTFT / ITL / e2e p50 and p99
per system, the ratios, kvflow's time outside the forward pass at batch >= 32 and its
steps by kind (prompt steps; decode steps of 1-8, 9-32, 33+ sequences: count, seconds,
share);
with --profile, a decode step's time split (linear layers, attention, sampling,
bookkeeping) at batch 16/32/64 and the linear layers' limit at those batch sizes.
Writes JSON, a Markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import Workload, make_longtail_workload, make_workload

from worker.config import LINEAR_BACKENDS, EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.outputs import StepStats
from worker.hardware import KEY_LAYOUTS, KV_CACHE_DTYPES
from worker.request import SamplingParams, percentile

# prompt steps profiled with --profile (prompts x tokens, prefilled in one step each):
# few rows and a full default token budget
PROMPT_SHAPES = ((1, 256), (8, 256))
SYSTEMS = (
    "kvflow-continuous",
    "kvflow-gather",
    "kvflow-static",
    "hf-generate",
    "hf-generate-batch",
)


@dataclass
class Result:
    system: str
    wall_s: float
    output_tokens: int
    prompt_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def computed_tok_s(self) -> float:
        """Prompt and output tokens per second (the prompts' tokens as sent)."""
        return (self.output_tokens + self.prompt_tokens) / self.wall_s

    def q(self, name: str, p: float) -> float:
        xs = sorted(getattr(self, name))
        return percentile(xs, p) if xs else math.nan


# -- kvflow --------------------------------------------------------------------------------

# Kinds of step by what they computed: a step with any prompt tokens, then decode-only
# steps by the sequences in them (bounds inclusive).
STEP_KINDS = (
    ("with prompt tokens", None),
    ("decode, 1-8 sequences", (1, 8)),
    ("decode, 9-32 sequences", (9, 32)),
    ("decode, 33+ sequences", (33, 1 << 30)),
)


def step_split(stats: list[StepStats]) -> list[dict[str, float | str]]:
    """Where a run's step time went: per kind of step, its count, seconds, share of all
    steps' time and the tokens (prompt + decode) those steps computed."""
    total = sum(s.step_time_s for s in stats) or 1.0
    rows: list[dict[str, float | str]] = []
    for name, bounds in STEP_KINDS:
        if bounds is None:
            steps = [s for s in stats if s.num_prefill_tokens > 0]
        else:
            lo, hi = bounds
            steps = [s for s in stats if s.num_prefill_tokens == 0 and lo <= s.batch_size <= hi]
        seconds = sum(s.step_time_s for s in steps)
        rows.append(
            {
                "kind": name,
                "steps": len(steps),
                "seconds": seconds,
                "share": seconds / total,
                "prompt_tokens": sum(s.num_prefill_tokens for s in steps),
                "decode_tokens": sum(s.num_decode_tokens for s in steps),
            }
        )
    return rows


def split_table(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| steps | count | s | share of step time | prompt tokens | decode tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['steps']} | {float(r['seconds']):.2f} | {float(r['share']):.0%} "
            f"| {r['prompt_tokens']} | {r['decode_tokens']} |"
        )
    return "\n".join(lines)


def run_kvflow(engine: LLMEngine, wl: Workload, name: str) -> Result:
    t0 = time.time()
    for i, (p, m) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        engine.add_request(
            f"{name}-{i}",
            p,
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
            arrival_time=t0,
        )
    engine.recent_stats.clear()
    stats = []
    res = Result(name, 0.0, 0)
    with tqdm(total=wl.output_tokens, desc=name, unit="tok", file=sys.stderr) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                bar.update(len(out.delta_token_ids))
                if out.finished:
                    t = out.timing
                    res.output_tokens += len(out.token_ids)
                    res.ttft.append(t.ttft_s)
                    res.e2e.append(t.e2e_s)
                    if t.itl_mean_s is not None:
                        res.itl.append(t.itl_mean_s)
            stats.append(engine.last_stats)
    res.wall_s = time.time() - t0
    big = [s for s in stats if s.batch_size >= 32]
    step_time = sum(s.step_time_s for s in big)
    if step_time:
        res.extra["overhead_frac_b32"] = sum(s.overhead_s for s in big) / step_time
        res.extra["sample_frac_b32"] = sum(s.sample_time_s for s in big) / step_time
    res.extra["mean_batch"] = float(np.mean([s.batch_size for s in stats]))
    res.extra["steps"] = len(stats)
    res.extra["preemptions"] = float(engine.scheduler.num_preemptions)
    res.extra["timeline"] = [(s.started_at - t0, s.batch_size, s.kv_usage) for s in stats]  # type: ignore[assignment]
    res.extra["step_split"] = step_split(stats)  # type: ignore[assignment]
    return res


# -- transformers ----------------------------------------------------------------------------


def run_hf_generate(model, wl: Workload, batch_size: int, pad_id: int) -> Result:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.time())
            return scores

    res = Result("hf-generate", 0.0, 0)
    t0 = time.time()
    bar = tqdm(total=wl.output_tokens, desc="hf-generate", unit="tok", file=sys.stderr)
    for b in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[b : b + batch_size]
        lens = wl.output_lens[b : b + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        clock = StepClock()
        steps = max(lens)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        end = time.time()
        for n in lens:  # a request's useful tokens are its first n; it returns with the batch
            times = clock.times[:n]
            res.ttft.append(times[0] - t0)
            res.e2e.append(end - t0)
            if n > 1:
                res.itl.append((times[-1] - times[0]) / (n - 1))
            res.output_tokens += n
        bar.update(sum(lens))
    bar.close()
    res.wall_s = time.time() - t0
    res.extra["useful_slot_frac"] = wl.output_tokens / sum(
        max(wl.output_lens[b : b + batch_size]) * len(wl.output_lens[b : b + batch_size])
        for b in range(0, len(wl.output_lens), batch_size)
    )
    return res


def run_hf_generate_batch(model, wl: Workload) -> Result:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    res = Result("hf-generate-batch", 0.0, 0)
    t0 = time.time()
    t0_perf = time.perf_counter()
    ids = [
        manager.add_request(
            p, request_id=f"r{i}", max_new_tokens=m, record_timestamps=True, eos_token_id=-1
        )
        for i, (p, m) in enumerate(zip(wl.prompts, wl.output_lens, strict=True))
    ]
    done = 0
    with tqdm(total=len(ids), desc="hf-generate-batch", unit="req", file=sys.stderr) as bar:
        while done < len(ids):
            out = manager.get_result(timeout=1)
            if out is None or not out.is_finished():
                continue
            done += 1
            bar.update(1)
            ts = out.timestamps or []
            res.output_tokens += len(out.generated_tokens)
            if ts:
                res.ttft.append(ts[0] - t0_perf)
                res.e2e.append(ts[-1] - t0_perf)
                if len(ts) > 1:
                    res.itl.append((ts[-1] - ts[0]) / (len(ts) - 1))
    res.wall_s = time.time() - t0
    manager.stop(block=True)
    return res


# -- report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """One round of the alternation: output tok/s of kvflow-continuous, then of
    llama-server at its best slot count, each a whole run of the workload."""

    ours: float
    theirs: float

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs


def medians(pairs: list[Pair]) -> Pair:
    """Each system's median over the pairs (its ratio: the ratio of medians)."""
    return Pair(
        statistics.median(p.ours for p in pairs), statistics.median(p.theirs for p in pairs)
    )


def ratio_of_medians(pairs: list[Pair]) -> float:
    return medians(pairs).ratio


def pairs_summary(pairs: list[Pair]) -> str:
    ratios = sorted(p.ratio for p in pairs)
    mid = medians(pairs)
    return (
        f"{len(pairs)} alternating pairs: {mid.ratio:.2f}x the medians "
        f"({mid.ours:.1f} against {mid.theirs:.1f} output tok/s), pairs "
        f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
    )


def pairs_table(pairs: list[Pair], slots: int) -> str:
    lines = [
        f"Alternating pairs after the sweep (llama-server at {slots} slots), output tok/s:",
        "",
        "| round | kvflow-continuous | llama-server | ratio |",
        "|---:|---:|---:|---:|",
    ]
    rows = [(str(i), p) for i, p in enumerate(pairs, 1)] + [("median", medians(pairs))]
    for name, p in rows:
        lines.append(f"| {name} | {p.ours:.1f} | {p.theirs:.1f} | {p.ratio:.2f}x |")
    return "\n".join(lines)


def plot_pairs(pairs: list[Pair], slots: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rounds = np.arange(1, len(pairs) + 1)
    ax.plot(rounds, [p.ours for p in pairs], "o-", color="#2a7", label="kvflow-continuous")
    ax.plot(
        rounds, [p.theirs for p in pairs], "s-", color="#999", label=f"llama-server ({slots} slots)"
    )
    for r, p in zip(rounds, pairs, strict=True):
        ax.annotate(
            f"{p.ratio:.2f}x", (r, p.ours), textcoords="offset points", xytext=(0, 6), ha="center"
        )
    ax.set_xticks(rounds)
    ax.set_xlabel("round (kvflow first, then llama-server)")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(0, 1.15 * max(p.ours for p in pairs))  # room for the ratios above the points
    ax.set_title(f"alternating pairs: {ratio_of_medians(pairs):.2f}x the medians")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[Result], base: str) -> str:
    ref = {r.system: r.tok_s for r in results}
    lines = [
        "| system | output tok/s | computed tok/s | kvflow-continuous ÷ this | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | e2e p50 / p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = ref.get(base, math.nan) / r.tok_s
        lines.append(
            f"| {r.system} | {r.tok_s:.1f} | {r.computed_tok_s:.0f} | {ratio:.2f}x | {r.q('ttft', 50):.1f} / {r.q('ttft', 99):.1f} | "
            f"{r.q('itl', 50) * 1e3:.0f} / {r.q('itl', 99) * 1e3:.0f} | {r.q('e2e', 50):.1f} / {r.q('e2e', 99):.1f} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r.system for r in results]
    axes[0].bar(
        names,
        [r.tok_s for r in results],
        color=["#2a7", "#7b5", "#c66", "#d94", "#58c", "#999"][: len(results)],
    )
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("throughput (same workload)")
    axes[0].tick_params(axis="x", rotation=20)
    for metric, ax, scale, label in (
        ("ttft", axes[1], 1.0, "TTFT (s)"),
        ("e2e", axes[1], 1.0, "e2e (s)"),
    ):
        del scale
        xs = np.arange(len(results))
        off = -0.2 if metric == "ttft" else 0.2
        ax.bar(xs + off, [r.q(metric, 50) for r in results], 0.4, label=f"{label} p50")
        ax.scatter(xs + off, [r.q(metric, 99) for r in results], marker="_", s=300, color="k")
    axes[1].set_xticks(np.arange(len(results)), names, rotation=20)
    axes[1].set_title("latency p50 (bars) and p99 (ticks)")
    axes[1].legend()
    for r in results:
        tl = r.extra.get("timeline")
        if tl:
            t = [x[0] for x in tl]  # type: ignore[index]
            axes[2].plot(t, [x[1] for x in tl], label=f"{r.system} batch size")  # type: ignore[index]
    axes[2].set_xlabel("s since submit")
    axes[2].set_title("requests in the batch, per step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", "--num-requests", type=int, default=128)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--linear", default="auto", choices=LINEAR_BACKENDS, help="CPU linear layers")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--key-layout", default="auto", choices=KEY_LAYOUTS)
    ap.add_argument("--workload", choices=("mixed", "longtail"), default="mixed")
    ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary")
    ap.add_argument("--llama-slots", default="1,2,4,8,16")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --llama-server: alternating pairs of kvflow-continuous and llama-server "
        "at its best slot count after the sweep (0: none)",
    )
    ap.add_argument("--profile", action="store_true", help="profile decode at batch 16/32/64")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 0:
        ap.error(f"--rounds must be 0 or more, not {args.rounds}")
    if args.rounds and args.llama_server is not None and "kvflow-continuous" not in systems:
        ap.error("--rounds alternates kvflow-continuous with llama-server: add it to --systems")
    args.out.mkdir(parents=True, exist_ok=True)

    cfg = EngineConfig(
        dtype=args.dtype,
        linear=args.linear,
        kv_cache_dtype=args.kv_cache_dtype,
        key_layout=args.key_layout,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = LLMEngine(cfg)
    if args.workload == "longtail":
        wl = make_longtail_workload(engine.tokenizer, 64, args.seed)
    else:
        wl = make_workload(engine.tokenizer, args.num_requests, args.seed)
    cpu = cpu_model()
    print(
        f"workload {args.workload}: {wl.describe()}; {cpu}; kvflow {engine.info.dtype} "
        f"({engine.info.dtype_reason}), {engine.info.num_threads} threads, "
        f"linear layers {engine.info.linear}, attention {engine.info.attention}, "
        f"KV cache {engine.info.kv_cache_dtype}, keys as {engine.info.key_layout}",
        file=sys.stderr,
    )
    warm = Workload(wl.prompts[:2], [4, 4])
    runners: dict[str, Callable[[], Result]] = {}
    hf_model = None

    def hf():
        nonlocal hf_model
        if hf_model is None:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(
                engine.loaded.path,
                dtype=torch.float32
                if engine.info.dtype == "int8"
                else getattr(torch, engine.info.dtype),
            ).eval()
        return hf_model

    def kv(mode: str, attention: str = "auto", name: str = "") -> Result:
        eng = LLMEngine(
            EngineConfig(
                **{
                    **asdict(cfg),
                    "scheduling": mode,
                    "attention": attention,
                    # keys in pairs are for the C kernel; the gather path reads rows
                    "key_layout": cfg.key_layout if attention == "auto" else "rows",
                }
            ),
            loaded=engine.loaded,
        )
        run_kvflow(eng, warm, "warmup")
        return run_kvflow(eng, wl, name or f"kvflow-{mode}")

    runners["kvflow-continuous"] = lambda: kv("continuous")
    runners["kvflow-gather"] = lambda: kv("continuous", "torch", "kvflow-gather")
    runners["kvflow-static"] = lambda: kv("static")
    runners["hf-generate"] = lambda: (
        run_hf_generate(hf(), warm, 2, 0),
        run_hf_generate(hf(), wl, args.hf_batch_size, 0),
    )[1]
    runners["hf-generate-batch"] = lambda: run_hf_generate_batch(hf(), wl)
    results = [runners[s]() for s in systems]
    for r in results:
        r.prompt_tokens = wl.prompt_tokens
    peer_runs = []
    pairs: list[Pair] = []
    if args.llama_server is not None:
        from llama_peer import run_peer, run_slots

        from worker.model.gguf import default_model_path

        slots = tuple(int(s) for s in args.llama_slots.split(","))
        peer_runs = run_peer(
            args.llama_server, default_model_path(), wl, slots, engine.info.num_threads
        )
        best = max(peer_runs, key=lambda p: p.tok_s)
        results.append(
            Result(
                f"llama-server ({best.slots} slots)",
                best.wall_s,
                best.output_tokens,
                best.prompt_tokens,
            )
        )
        for _ in range(args.rounds):
            ours = runners["kvflow-continuous"]().tok_s
            theirs = run_slots(
                args.llama_server, default_model_path(), wl, best.slots, engine.info.num_threads
            ).tok_s
            pairs.append(Pair(ours, theirs))
    profile_rows = []
    prompt_rows = []
    gather_rows = []
    curve_md = ""
    limit_label = gather_label = ""
    if args.profile:
        import step_profile

        # Engines built on one loaded model share its linear layers, laid out for the
        # latest engine built (worker.model.packing): each engine's steps run before the
        # next one is built, so the curve precedes the gather engine (whose torch attention
        # takes float32 layers where int16 ones need the C layer ops).
        prof_engine = LLMEngine(EngineConfig(**asdict(cfg)), loaded=engine.loaded)
        profile_rows = step_profile.run(
            prof_engine, (16, 32, 64), lambda m: print(m, file=sys.stderr)
        )
        limit_label = step_profile.limit_label(prof_engine)
        for n, tokens in (p for p in PROMPT_SHAPES if p[0] * p[1] <= cfg.max_num_batched_tokens):
            print(f"profiling prompt steps of {n} x {tokens} tokens", file=sys.stderr)
            prompt_rows.append(step_profile.profile_prompt(prof_engine, n, tokens))
        print("decode tok/s by batch size", file=sys.stderr)
        curve, context, choice = step_profile.batch_curve(prof_engine)
        curve_md = step_profile.curve_table(curve, context, choice)
        step_profile.plot_curve(curve, choice, args.out / "batch_curve.png")
        if "kvflow-gather" in systems:  # the same steps with the gather path, for the split
            gather = LLMEngine(
                EngineConfig(**{**asdict(cfg), "attention": "torch", "key_layout": "rows"}),
                loaded=engine.loaded,
            )
            gather_rows = step_profile.run(
                gather, (64,), lambda m: print(m + " (gather)", file=sys.stderr)
            )
            gather_label = step_profile.limit_label(gather)

    base = "kvflow-continuous"
    md = f"Workload {args.workload}: {wl.describe()}. CPU: {cpu}. kvflow dtype {engine.info.dtype} ({engine.info.dtype_reason}), {engine.info.num_threads} threads, linear layers {engine.info.linear}, attention {engine.info.attention}, KV cache {engine.info.kv_cache_dtype}, keys as {engine.info.key_layout}.\n\n"
    md += table(results, base)
    split = next((r.extra["step_split"] for r in results if r.system == base), None)
    if split:
        md += f"\n\n{base}'s steps by kind (where the run's time went):\n\n"
        md += split_table(split)  # type: ignore[arg-type]
    if peer_runs:
        md += "\n\nllama-server by slot count (output tok/s): " + ", ".join(
            f"{p.slots}: {p.tok_s:.1f}" for p in peer_runs
        )
    if pairs:
        md += f"\n\n{pairs_table(pairs, best.slots)}"
    if profile_rows:
        import step_profile

        md += "\n\nDecode step profile (ms per step, contexts ~256 tokens):\n\n"
        md += step_profile.table(profile_rows, limit_label)
        if gather_rows:
            md += "\n\nThe same at batch 64 with decode attention by block gather (--attention torch):\n\n"
            md += step_profile.table(gather_rows, gather_label)
        md += "\n\nPrompt step profile (ms per step; fresh prompts prefilled in one step):\n\n"
        md += step_profile.prompt_table(prompt_rows, limit_label)
        md += f"\n\nDecode tokens/s by batch size (`{args.out / 'batch_curve.png'}`):\n\n"
        md += curve_md
    print("\n" + md)
    cont = next((r for r in results if r.system == base), None)
    if cont is not None:
        for r in results:
            if r is not cont:
                print(f"{base} / {r.system}: {cont.tok_s / r.tok_s:.2f}x output tok/s")
        if "overhead_frac_b32" in cont.extra:
            print(
                f"{base}: time outside the forward pass at batch >= 32: "
                f"{cont.extra['overhead_frac_b32']:.1%} of step time "
                f"(sampling {cont.extra['sample_frac_b32']:.1%}); mean batch {cont.extra['mean_batch']:.1f}, "
                f"preemptions {cont.extra['preemptions']:.0f}"
            )
    if pairs:
        print(f"{base} / llama-server ({best.slots} slots), {pairs_summary(pairs)}")
    for r in results:
        if "useful_slot_frac" in r.extra:
            print(
                f"hf-generate: {r.extra['useful_slot_frac']:.0%} of computed token slots were useful"
            )
    (args.out / "engine.md").write_text(md + "\n")
    records: list[dict[str, object]] = [
        {
            "system": r.system,
            "output_tok_s": r.tok_s,
            "computed_tok_s": r.computed_tok_s,
            "wall_s": r.wall_s,
            "output_tokens": r.output_tokens,
            "ttft_p50": r.q("ttft", 50),
            "ttft_p99": r.q("ttft", 99),
            "itl_p50": r.q("itl", 50),
            "itl_p99": r.q("itl", 99),
            "e2e_p50": r.q("e2e", 50),
            "e2e_p99": r.q("e2e", 99),
            **{k: v for k, v in r.extra.items() if k != "timeline"},
        }
        for r in results
    ]
    if pairs:
        records.append(
            {
                "system": "alternating pairs",
                "llama_server_slots": best.slots,
                "kvflow_tok_s": [p.ours for p in pairs],
                "llama_server_tok_s": [p.theirs for p in pairs],
                "ratio_of_medians": ratio_of_medians(pairs),
            }
        )
    (args.out / "engine.json").write_text(json.dumps(records, indent=2))
    plot(results, args.out / "engine.png")
    if pairs:
        plot_pairs(pairs, best.slots, args.out / "pairs.png")
    print(
        f"wrote {args.out / 'engine.md'}, {args.out / 'engine.json'}, {args.out / 'engine.png'}",
        file=sys.stderr,
    )


def cpu_model() -> str:
    """The CPU's model name, and whether it multiplies bfloat16 faster than float32."""
    from worker.hardware import fast_bf16, read_cpu_flags, read_cpu_vendor

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = read_cpu_flags()
    native = fast_bf16(flags, read_cpu_vendor())
    if native:
        return f"{name} ({', '.join(native)})"
    if "avx512_bf16" in flags:
        return f"{name} (avx512_bf16 without AMX on an Intel core: bf16 no faster than float32)"
    return f"{name} (no native bf16)"


if __name__ == "__main__":
    main()
