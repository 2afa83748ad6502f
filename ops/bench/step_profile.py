"""Where a decode step's time goes, and what the linear layers alone allow.

    python ops/bench/step_profile.py                 # batch 16, 32, 64; dtype auto
    python ops/bench/step_profile.py --batches 64 --context 512  # longer contexts
    python ops/bench/step_profile.py --compare-layer-ops   # C layer ops vs torch ops
    python ops/bench/step_profile.py --compare-linear      # packed weights vs plain matmul
    python ops/bench/step_profile.py --linear int16 --compare-int16  # int16 vs float32
    python ops/bench/step_profile.py --compare-rows-kernel   # C row kernel vs oneDNN
    python ops/bench/step_profile.py --compare-layer-stack   # layers as one run of C calls
    python ops/bench/step_profile.py --no-rows-kernel --compare-layer-stack  # over oneDNN
    python ops/bench/step_profile.py --prompts 1x256,8x256  # prompt steps instead
    python ops/bench/step_profile.py --compare-prefill 8x256,4x256+128  # prompt attention paths

`profile_prompt` does the same for prompt steps: fresh prompts prefilled in one step each,
split by the same timers, against the linear layers alone at the step's rows.

`profile_decode` fills the engine with `batch` sequences (prompts of `context` tokens),
then runs decode-only steps with the model's linear layers, attention, forward pass and
sampler timed as they run (wall-clock timers around each call; CPU calls are synchronous,
CUDA ones are synchronised around each timer), or with `--torch-profiler` under the
torch profiler with the same calls labelled. What is left of a step is bookkeeping
(scheduling, inputs, output processing) and the model's other ops (norms, rotary,
residual adds). The timers are the default because the profiler's own cost per op lands
unevenly: on an Intel Xeon with AMX it put the linear layers of a batch-64 step at 42-44
ms where timers (and passes of the layers alone) give 26-27.
Between the timed steps it times the same linear layers alone on random inputs of the
same batch size and dtype: the tokens/s a decode step could reach if nothing else cost
anything (the best pass is the limit; the share against the median pass compares like
with like on a machine whose speed drifts).
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker.engine.model_runner as runner_mod
import worker.model.llama as llama_mod
import worker.model.quant as quant_mod
from worker.config import LINEAR_BACKENDS, EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.tuning import choose_batch, measure_curve
from worker.hardware import KEY_LAYOUTS, KV_CACHE_DTYPES
from worker.model.native import NativeKernels, prefill_kernel_fits
from worker.model.packing import attach_rows_weights, pack_linear_layers
from worker.request import SamplingParams

PHASES = ("linear", "attention", "sampling", "other model ops", "bookkeeping")


@dataclass
class StepProfile:
    batch: int
    step_ms: float  # median over steps run without the profiler (wall)
    phases_ms: dict[str, float]  # per step
    limit_tok_s: float  # the linear layers alone: best pass
    limit_median_tok_s: float  # median of the passes run between the timed steps
    bytes_read: float = 0.0  # what a step must read at least: weights and K/V (`step_bytes`)
    read_gb_s: float = 0.0  # the memory's read rate (`read_bandwidth`); 0: not measured
    # mean wall ms of the further steps the phases were timed over (the phases sum to it);
    # 0: not recorded
    split_ms: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.batch / (self.step_ms / 1000)

    @property
    def memory_ms(self) -> float:
        """The step's bytes at the memory's read rate: what the hardware allows a step
        that reads each weight and each cached K/V row once."""
        return self.bytes_read / (self.read_gb_s * 1e9) * 1000 if self.read_gb_s else 0.0

    @property
    def label(self) -> str:
        return str(self.batch)


class PhaseTimers:
    """Seconds per label, each call timed only where no call of the same label is already
    running (the output projection's matmul inside `compute_logits` counts once); linear
    layers called inside the forward pass are kept apart ("kv.linear in forward")."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.totals: dict[str, float] = {}
        self._active: set[str] = set()
        self._sync = sync

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            if label in self._active:
                return fn(*a, **kw)
            self._sync()
            self._active.add(label)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._sync()
                self._active.discard(label)
                inside = label == "kv.linear" and "kv.forward" in self._active
                key = label + (" in forward" if inside else "")
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - t0

        return call


def _profiled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    def call(*a: Any, **kw: Any) -> Any:
        with record_function(label):
            return fn(*a, **kw)

    return call


@contextmanager
def _labelled(engine: LLMEngine, timers: PhaseTimers | None = None) -> Iterator[None]:
    """Label linear layers, attention, the forward pass and sampling: timed by `timers`,
    else for the torch profiler."""
    saved: list[tuple[Any, str, Any, bool]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, fn, name in vars(owner)))
        setattr(owner, name, _profiled(fn, label) if timers is None else timers.timed(fn, label))

    wrap(llama_mod, "paged_attention", "kv.attention")
    # a Linear's forward is narrow_input, matmul, then the cast back; the C layer ops
    # path calls the first two itself
    wrap(llama_mod.Linear, "narrow_input", "kv.linear")
    wrap(llama_mod.Linear, "matmul", "kv.linear")
    wrap(quant_mod.Int8Linear, "forward", "kv.linear")
    # the MLP's int16 down projection, its SiLU computed as its inputs are rounded
    wrap(NativeKernels, "linear_i16_silu", "kv.linear")
    stack = engine.runner.layer_stack
    if stack is not None:  # steps it takes call the kernels straight from its own methods
        wrap(stack, "_linear", "kv.linear")
        wrap(stack, "decode", "kv.attention")
        # its loop in C is out of the timers' reach: the split's steps take its Python
        # loop (the same kernels, ~270 ctypes calls more a step of 30 layers); the steps
        # timed whole, outside the split, still take the C loop
        saved.append((stack, "c_stack", stack.c_stack, True))
        stack.c_stack = None
    wrap(engine.runner.model, "forward", "kv.forward")
    wrap(engine.runner.model, "compute_logits", "kv.linear")
    wrap(engine.runner.model, "greedy_tokens", "kv.linear")  # a greedy step's, in its place
    wrap(engine.runner, "sampler", "kv.sampling")
    try:
        yield
    finally:
        for owner, name, fn, own in reversed(saved):
            if own:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # a bound method: the class's comes back


def _separate_silu(
    self: NativeKernels, gate_up: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`NativeKernels.linear_i16_silu` as two calls: SiLU and multiply stored, then the
    int16 products (the same values, bit for bit; `--separate-silu`)."""
    return self.linear_i16(self.silu_mul(gate_up), weight, bias)


def _fill(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    """`batch` requests with `context`-token prompts, all prefilled, ready to decode."""
    if batch > engine.config.max_num_seqs:
        raise ValueError(
            f"batch {batch} exceeds the engine's max_num_seqs {engine.config.max_num_seqs}"
        )
    # The first prompts decode while the last are prefilled (a step's token budget, less a
    # token for each running sequence, at a time): each must outlast the fill, else the
    # batch is never whole. And every sequence's blocks at once, to its last token.
    budget = max(1, engine.config.max_num_batched_tokens - batch)
    fill_steps = -(-batch * context // budget) + 1
    max_tokens = steps + fill_steps + 8
    bs = engine.runner.block_size
    need = batch * -(-(context + max_tokens) // bs)
    if need > engine.info.num_blocks:
        raise ValueError(
            f"{batch} sequences of {context} tokens need {need} KV blocks; the cache holds "
            f"{engine.info.num_blocks} (lower --batches or --context)"
        )
    g = torch.Generator().manual_seed(batch)
    vocab = engine.info.vocab_size
    for i in range(batch):
        prompt = torch.randint(100, vocab, (context,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"p{batch}-{i}", prompt, params)
    while engine.scheduler.requests:
        engine.step()
        s = engine.last_stats
        if s is not None and s.num_prefill_tokens == 0 and s.batch_size == batch:
            return
    raise RuntimeError(f"the engine never ran {batch} sequences of {context} tokens at once")


def profile_decode(
    engine: LLMEngine,
    batch: int,
    context: int = 256,
    steps: int = 12,
    repeats: int = 25,
    torch_profiler: bool = False,
) -> StepProfile:
    """`steps` decode-only steps at `batch` sequences of about `context` tokens timed as
    they run (the median is the step time), each followed by one timed pass of the linear
    layers alone (more passes after, `repeats` in all), so that both see
    the same moments of a noisy machine; then `steps` more, timed per phase (or under the
    torch profiler) for the split; the timers' or the profiler's own cost stays out of
    the step time."""
    _fill(engine, batch, context, 2 * steps)
    layers = _linear_layers(engine, batch)
    times, passes = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        passes.append(_linear_pass(layers))
    between = statistics.median(passes)
    passes += [_linear_pass(layers) for _ in range(max(0, repeats - steps))]
    if torch_profiler:
        with _labelled(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            split = (time.perf_counter() - t0) / steps * 1000
        totals = {e.key: e.cpu_time_total / 1000 / steps for e in prof.key_averages()}
        # compute_logits runs outside forward; its time is in "linear" but not "forward".
        inside = _inside_forward_linear(prof, steps)
        logits = totals.get("kv.linear", 0.0) - inside
    else:
        cuda = engine.runner.device.type == "cuda"
        timers = PhaseTimers(torch.cuda.synchronize if cuda else lambda: None)
        with _labelled(engine, timers):
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            split = (time.perf_counter() - t0) / steps * 1000
        totals = {k: v * 1000 / steps for k, v in timers.totals.items()}  # ms per step
        inside = totals.get("kv.linear in forward", 0.0)
        logits = totals.get("kv.linear", 0.0)
    engine.abort(list(engine.scheduler.requests))
    wall = statistics.median(times) * 1000
    phases = _phases(totals, split, inside, logits)
    # the timed steps' contexts: `context` tokens prefilled, then one more a step
    nbytes = step_bytes(engine, batch, context + (steps + 1) / 2)
    rate = read_bandwidth() if engine.runner.device.type == "cpu" else 0.0
    limit, limit_median = batch / min(passes), batch / between
    return StepProfile(batch, wall, phases, limit, limit_median, nbytes, rate, split)


def step_bytes(engine: LLMEngine, batch: int, context: float) -> float:
    """Bytes a decode step of `batch` sequences of `context` cached tokens reads at least:
    each linear layer's weight once, in the form its path reads at `batch` rows (the int16
    copy, the row kernel's copy, the packed or plain weight, int8 ones), the output
    projection's (the narrow copy where there is one; the float32 re-scoring of a few
    candidate rows left out), and every cached K and V row once."""
    runner = engine.runner
    model, ops = runner.model, runner.step_ops
    weights = 0
    for m in model.modules():
        if isinstance(m, llama_mod.Linear):
            path = m.path(batch, ops)
            if path == "int16" and m.int16_weight is not None:
                weights += m.int16_weight.nbytes
            elif path == "rows" and m.rows_weight is not None:
                weights += m.rows_weight.nbytes
            else:
                weights += m.weight.shape[0] * m.weight.shape[1] * m.weight.dtype.itemsize
        elif isinstance(m, quant_mod.Int8Linear):
            weights += m.out_features * m.in_features + 4 * m.out_features  # int8, scales
    if model.narrow_head is None:
        weights += model.output_weight.nbytes
    # a token's K and V rows in every layer, as the caches hold them ([NB, KVH, BS, row];
    # keys in pairs [NB, KVH, D / 2, BS, 2], a token's D values a head all the same)
    per_token = sum(
        (k.numel() * k.element_size() + v.numel() * v.element_size()) // (v.shape[0] * v.shape[2])
        for k, v in runner.kv_caches
    )
    return weights + batch * context * per_token


@functools.cache
def read_bandwidth(gib: int = 1, repeats: int = 5) -> float:
    """GB/s the CPU reads at from memory with all of torch's threads: the best of
    `repeats` sums of a `gib` GiB float32 tensor (far larger than any cache), once per
    process."""
    x = torch.ones(gib * (1 << 30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _phases(
    totals: dict[str, float], split: float, inside: float, logits: float
) -> dict[str, float]:
    """ms per step of each of PHASES, from the labelled totals of a step that took `split`
    ms (linear layers inside the forward pass, and the output projection's outside it)."""
    attention = totals.get("kv.attention", 0.0)
    forward = totals.get("kv.forward", 0.0)
    sampling = totals.get("kv.sampling", 0.0)
    return {
        "linear": inside + logits,
        "attention": attention,
        "sampling": sampling,
        "other model ops": max(0.0, forward - inside - attention),
        "bookkeeping": max(0.0, split - forward - logits - sampling),
    }


@dataclass
class PromptProfile:
    prompts: int
    tokens: int  # per prompt
    step_ms: float  # median over the timed steps (wall)
    phases_ms: dict[str, float]  # medians per step
    limit_tok_s: float  # the linear layers alone at prompts x tokens rows: best pass
    limit_median_tok_s: float
    faults: int = 0  # minor page faults a step (median): freed memory zeroed again

    @property
    def tok_s(self) -> float:
        return self.prompts * self.tokens / (self.step_ms / 1000)

    @property
    def label(self) -> str:
        return f"{self.prompts} x {self.tokens}"


def profile_prompt(engine: LLMEngine, prompts: int, tokens: int, steps: int = 5) -> PromptProfile:
    """`steps` prompt steps, each of `prompts` fresh prompts of `tokens` random tokens (no
    cached opening) prefilled at once, timed per phase; after each, a pass of the linear
    layers alone at the same rows (the decoder's at prompts x tokens, the output
    projection's at `prompts`, where a prompt step samples). A prompt step is long next to
    the timers' cost per call (~150 calls a step), so one timed run gives both the wall
    time and the split."""
    rows = prompts * tokens
    if rows > engine.config.max_num_batched_tokens:
        raise ValueError(
            f"{prompts} prompts of {tokens} tokens exceed the token budget of a step "
            f"({engine.config.max_num_batched_tokens})"
        )
    # seeded by the shape, not the row count: 1 x 2048 and 8 x 256 drawing the same tokens
    # would find the first prompt in the prefix cache
    g = torch.Generator().manual_seed(prompts * 100_003 + tokens)
    vocab = engine.info.vocab_size
    layers = _linear_layers(engine, rows, head_rows=prompts)
    walls: list[float] = []
    passes: list[float] = []
    faults: list[int] = []
    split: dict[str, list[float]] = {p: [] for p in PHASES}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for step in range(steps + 1):  # the first warms up: not counted
        for i in range(prompts):
            prompt = torch.randint(100, vocab, (tokens,), generator=g).tolist()
            engine.add_request(f"prompt{rows}-{step}-{i}", prompt, params)
        timers = PhaseTimers(lambda: None)
        with _labelled(engine, timers):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - t0) * 1000
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        stats = engine.last_stats
        if stats is None or stats.num_prefill_tokens != rows:
            engine.abort(list(engine.scheduler.requests))
            raise RuntimeError(
                f"the step prefilled {stats and stats.num_prefill_tokens} of {rows} tokens"
            )
        engine.abort(list(engine.scheduler.requests))  # one token each: done already, if not
        if step == 0:
            continue
        totals = {k: v * 1000 for k, v in timers.totals.items()}
        phases = _phases(
            totals, wall, totals.get("kv.linear in forward", 0.0), totals.get("kv.linear", 0.0)
        )
        walls.append(wall)
        for p in PHASES:
            split[p].append(phases[p])
        passes.append(_linear_pass(layers))
    return PromptProfile(
        prompts,
        tokens,
        statistics.median(walls),
        {p: statistics.median(v) for p, v in split.items()},
        rows / min(passes),
        rows / statistics.median(passes),
        int(statistics.median(faults[1:])),
    )


def prompt_table(rows: list[PromptProfile], dtype: str) -> str:
    return _table("prompts x tokens", "prompt tok/s", rows, dtype)


def _inside_forward_linear(prof: Any, steps: int) -> float:
    """ms per step of linear layers run inside the forward pass (not the output projection)."""
    total = 0.0
    for e in prof.events():
        if e.name == "kv.linear" and _has_ancestor(e, "kv.forward"):
            total += e.cpu_time_total
    return total / 1000 / steps


def _has_ancestor(event: Any, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


Layer = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def _linear_layers(engine: LLMEngine, batch: int, head_rows: int | None = None) -> list[Layer]:
    """The model's linear layers (decoder layers + output projection), each with a random
    [batch, in] input in its own dtype (float32 into int8 layers); the output projection's
    [head_rows, in] (default `batch`: a decode step's logits). Each runs its matmul as a
    step runs it: int16 products and the C row kernel go through the C layer ops."""
    model = engine.runner.model
    ops = engine.runner.step_ops
    head_rows = batch if head_rows is None else head_rows
    head_modules = set(model.narrow_head.modules()) if model.narrow_head is not None else set()
    layers: list[Layer] = []
    for m in model.modules():
        n = head_rows if m in head_modules else batch
        if isinstance(m, llama_mod.Linear):  # its own matmul: packed, plain or int16
            w = m.weight
            fn = partial(m.matmul, tokens=n, ops=ops)
            layers.append((torch.randn(m.rows_for(n), w.shape[1], dtype=w.dtype), fn))
        elif isinstance(m, quant_mod.Int8Linear):  # float32 in, the module's own steps
            layers.append((torch.randn(n, m.in_features), m))
    if model.narrow_head is None:  # else the narrow projection is one of the modules above
        head = model.output_weight
        layers.append(
            (
                torch.randn(head_rows, head.shape[1], dtype=head.dtype),
                partial(F.linear, weight=head),
            )
        )
    return layers


def _linear_pass(layers: list[Layer]) -> float:
    """Seconds for one pass of the linear layers alone."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        for x, fn in layers:
            fn(x)
        return time.perf_counter() - t0


def run(
    engine: LLMEngine,
    batches: tuple[int, ...],
    progress: Callable[[str], None] | None = None,
    torch_profiler: bool = False,
    context: int = 256,
) -> list[StepProfile]:
    """A decode step's profile, with the linear-layer limit, for each batch size, its
    sequences of about `context` cached tokens."""
    out = []
    for b in batches:
        if progress is not None:
            progress(f"profiling decode at batch {b}, contexts of {context}")
        out.append(profile_decode(engine, b, context, torch_profiler=torch_profiler))
    return out


def _has_int16_layers(engine: LLMEngine) -> bool:
    return any(
        isinstance(m, llama_mod.Linear) and m.int16_weight is not None
        for m in engine.runner.model.modules()
    )


def limit_label(engine: LLMEngine) -> str:
    """What the linear-layer limit computes in: the dtype, or how float32 is computed."""
    int16 = _has_int16_layers(engine)
    return f"{engine.info.dtype} as int16 products" if int16 else engine.info.dtype


def table(rows: list[StepProfile], dtype: str) -> str:
    return _table("batch", "tok/s", rows, dtype)


def _table(first: str, rate: str, rows: Sequence[StepProfile | PromptProfile], dtype: str) -> str:
    head = f"| {first} | step ms | {rate} | " + " | ".join(f"{p} ms" for p in PHASES)
    head += f" | linear-layer limit tok/s ({dtype}) | share of limit |"
    head += " share of the limit's median pass |"
    # decode steps measured on CPU: their bytes against the memory's read rate
    memory = bool(rows) and all(isinstance(p, StepProfile) and p.read_gb_s for p in rows)
    if memory:
        head += " MB read | memory limit ms | share of the memory limit |"
    lines = [head, "|" + "---|" * (len(PHASES) + 6 + (3 if memory else 0))]
    for p in rows:
        cells = " | ".join(f"{p.phases_ms[k]:.1f}" for k in PHASES)
        line = (
            f"| {p.label} | {p.step_ms:.1f} | {p.tok_s:.0f} | {cells} | {p.limit_tok_s:.0f} | "
            f"{p.tok_s / p.limit_tok_s:.0%} | {p.tok_s / p.limit_median_tok_s:.0%} |"
        )
        if memory and isinstance(p, StepProfile):
            line += (
                f" {p.bytes_read / 1e6:.0f} | {p.memory_ms:.1f} | {p.memory_ms / p.step_ms:.0%} |"
            )
        lines.append(line)
    if memory:
        gb_s = rows[0].read_gb_s if isinstance(rows[0], StepProfile) else 0.0
        lines.append(
            f"\nMemory limit: the bytes a step must read (each weight and each cached K/V row "
            f"once) at {gb_s:.1f} GB/s, this CPU's read rate (a sum over 1 GiB)."
        )
    split = [p for p in rows if isinstance(p, StepProfile) and p.split_ms]
    if split:
        lines.append(split_note(split))
    return "\n".join(lines)


def split_note(rows: Sequence[StepProfile]) -> str:
    """The decode table's parts come from steps of their own, timed part by part after
    the steps timed whole: on a machine whose speed drifts the parts' sum can differ from
    the step's median, so say what they sum to."""
    means = " / ".join(f"{p.split_ms:.1f}" for p in rows)
    labels = " / ".join(p.label for p in rows)
    return (
        f"\nThe parts (linear layers to bookkeeping) are ms per step over further steps timed "
        f"part by part, their mean {means} ms at batch {labels}; the step ms is the median of "
        f"the steps timed whole before them."
    )


def _alternate(
    engine: LLMEngine, batch: int, variants: dict[str, Callable[[], None]], rounds: int
) -> dict[str, float]:
    """Decode steps at `batch`, each variant set up (outside the timing) before its step,
    the variants alternating step by step in this one engine so that all see the same
    moments of the machine; median ms of `rounds` steps per variant."""
    _fill(engine, batch, 256, len(variants) * rounds + 4)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, setup in variants.items():
                setup()
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    finally:
        engine.abort(list(engine.scheduler.requests))
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def compare_layer_ops(engine: LLMEngine, batch: int = 64, rounds: int = 20) -> str:
    """Batch-`batch` decode steps with the C layer ops and with the torch ops, alternating."""
    runner = engine.runner
    ops = runner.layer_ops
    if ops is None:
        return "(no C layer ops here: nothing to compare)"

    def use(chosen: Any) -> Callable[[], None]:
        return lambda: setattr(runner, "layer_ops", chosen)

    try:
        med = _alternate(engine, batch, {"C layer ops": use(ops), "torch ops": use(None)}, rounds)
    finally:
        runner.layer_ops = ops
    lines = [f"| batch {batch} decode step | median ms ({rounds} steps) |", "|---|---:|"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in med.items()]
    ratio = med["C layer ops"] / med["torch ops"]
    return "\n".join(lines) + f"\n\nC layer ops / torch ops: {ratio:.2f}x"


def drop_rows_kernel(engine: LLMEngine) -> None:
    """The row kernel's copies of the weights dropped (the linear layers then oneDNN's at
    every row count), and the layer stack built again over what the layers now hold."""
    attach_rows_weights(engine.runner.model, None)
    engine.runner.build_layer_stack()


def compare_layer_stack(engine: LLMEngine, batches: tuple[int, ...], rounds: int = 20) -> str:
    """Decode steps with the decoder's layers as one run of C calls (worker.model.
    layer_stack), its loop in C where it has one, and layer by layer through the C layer
    ops, alternating step by step; and the stack's Python loop beside its C loop."""
    runner = engine.runner
    stack = runner.layer_stack
    if stack is None:
        return "(no layer stack here: it needs the C layer ops)"
    c_stack = stack.c_stack

    def use(on: bool, c_loop: bool = True) -> Callable[[], None]:
        def setup() -> None:
            runner.layer_stack = stack if on else None
            stack.c_stack = c_stack if c_loop else None

        return setup

    variants = {"stack": use(True), "layers": use(False)}
    head = "| batch | step, stack (ms) | step, layer by layer (ms) | stack / layer by layer |"
    if c_stack is not None:
        variants["python loop"] = use(True, c_loop=False)
        head += " step, the stack's loop in Python (ms) | C loop / Python loop |"
    lines = [head, "|---:|---:|---:|---:|" + ("---:|---:|" if c_stack is not None else "")]
    try:
        for batch in batches:
            med = _alternate(engine, batch, variants, rounds)
            ratio = med["stack"] / med["layers"]
            row = f"| {batch} | {med['stack']:.1f} | {med['layers']:.1f} | {ratio:.2f}x |"
            if c_stack is not None:
                py = med["python loop"]
                row += f" {py:.1f} | {med['stack'] / py:.3f}x |"
            lines.append(row)
    finally:
        runner.layer_stack, stack.c_stack = stack, c_stack
    return f"Decode steps, medians of {rounds} each:\n\n" + "\n".join(lines)


def _steps_and_passes(
    engine: LLMEngine, batch: int, variants: dict[str, Callable[[], None]], rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per variant of decode steps (`_alternate`), then of passes of the linear
    layers alone at the same batch, the variants alternating likewise."""
    med = _alternate(engine, batch, variants, rounds)
    layers = {}
    for name, setup in variants.items():
        setup()
        layers[name] = _linear_layers(engine, batch)
    passes: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, setup in variants.items():
            setup()
            passes[name].append(_linear_pass(layers[name]) * 1000)
    return med, {name: statistics.median(t) for name, t in passes.items()}


def _ratio_row(batch: int, med: dict[str, float], alone: dict[str, float]) -> str:
    """A table row: steps of the two variants and their ratio, then the passes alone."""
    a, b = med
    return (
        f"| {batch} | {med[a]:.1f} | {med[b]:.1f} | {med[a] / med[b]:.2f}x "
        f"| {alone[a]:.1f} | {alone[b]:.1f} | {alone[a] / alone[b]:.2f}x |"
    )


def _ratio_table(
    engine: LLMEngine,
    batches: tuple[int, ...],
    variants: dict[str, Callable[[], None]],
    rounds: int,
    restore: Callable[[], None],
) -> str:
    """`_ratio_row` for each batch size, the two variants' names in the header; `restore`
    puts the engine back as it was, whatever happens. The steps run layer by layer (the
    layer stack set aside: it would take one variant's steps and not the other's, where
    one of them swaps the weights it reads), so that only the kernels differ."""
    a, b = variants
    stack = engine.runner.layer_stack
    engine.runner.layer_stack = None
    lines = [
        f"| batch | step, {a} (ms) | step, {b} (ms) | {a} / {b} "
        f"| linear layers alone, {a} (ms) | {b} (ms) | {a} / {b} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    try:
        for batch in batches:
            lines.append(_ratio_row(batch, *_steps_and_passes(engine, batch, variants, rounds)))
    finally:
        restore()
        engine.runner.layer_stack = stack
    return "\n".join(lines)


def compare_linear(engine: LLMEngine, batches: tuple[int, ...], rounds: int = 20) -> str:
    """Decode steps with the linear weights packed for oneDNN and with torch's plain
    matmul, alternating step by step (both copies of the weights held, swapped untimed);
    then passes of the linear layers alone at the same batch, alternating likewise."""
    model, device = engine.runner.model, engine.runner.device.type
    chosen = engine.config.linear
    if _has_int16_layers(engine):
        return "(int16 linear layers here: run with --linear onednn, or --compare-int16)"
    try:
        pack_linear_layers(model, "onednn", device)
    except ValueError as e:
        return f"(nothing to compare: {e})"
    weights: dict[str, list[tuple[llama_mod.Linear, torch.nn.Parameter]]] = {}
    for choice in ("onednn", "torch"):
        pack_linear_layers(model, choice, device)
        weights[choice] = [
            (m, m.weight) for m in model.modules() if isinstance(m, llama_mod.Linear)
        ]
    rows_weights = _rows_weights(engine)  # oneDNN against torch: the row kernel set aside
    for m in rows_weights:
        m.rows_weight = None

    def use(choice: str) -> Callable[[], None]:
        def setup() -> None:
            for m, w in weights[choice]:
                m.weight = w

        return setup

    def restore() -> None:
        use("torch")()
        pack_linear_layers(model, chosen, device)
        for m, w in rows_weights.items():
            m.rows_weight = w

    variants = {"packed": use("onednn"), "plain": use("torch")}
    table = _ratio_table(engine, batches, variants, rounds, restore)
    return f"Decode step and linear layers alone, medians of {rounds} each:\n\n" + table


def _rows_weights(engine: LLMEngine) -> dict[llama_mod.Linear, torch.Tensor]:
    """The C row kernel's copies of the weights, by layer (none where it is not built)."""
    return {
        m: m.rows_weight
        for m in engine.runner.model.modules()
        if isinstance(m, llama_mod.Linear) and m.rows_weight is not None
    }


def compare_rows_kernel(engine: LLMEngine, batches: tuple[int, ...], rounds: int = 20) -> str:
    """Decode steps with the linear layers through the C row kernel (kernels/
    small_matmul.c) and through oneDNN's packed matmul, alternating step by step (the
    kernel's copies of the weights dropped and put back, untimed); then passes of the
    linear layers alone at the same batch, alternating likewise."""
    held = _rows_weights(engine)
    if not held:
        return "(nothing to compare: no C row kernel here; it needs avx512_bf16)"

    def use(kernel: bool) -> Callable[[], None]:
        def setup() -> None:
            for m, w in held.items():
                m.rows_weight = w if kernel else None

        return setup

    variants = {"row kernel": use(True), "oneDNN": use(False)}
    table = _ratio_table(engine, batches, variants, rounds, use(True))
    return f"Decode step and linear layers alone, medians of {rounds} each:\n\n" + table


def compare_int16(engine: LLMEngine, batches: tuple[int, ...], rounds: int = 20) -> str:
    """Decode steps with the decoder's float32 linear layers as 16-bit integer products
    (`--linear int16`) and in float32 through oneDNN's packed matmul, alternating step by
    step (both copies held, swapped untimed); then passes of the linear layers alone."""
    model, device = engine.runner.model, engine.runner.device.type
    if engine.runner.layer_ops is None or not engine.runner.layer_ops.int16_built:
        return "(nothing to compare: no int16 kernel or C layer ops here)"
    linears = [m for m in model.layers.modules() if isinstance(m, llama_mod.Linear)]
    held = {m: m.int16_weight for m in linears}
    if any(w is None for w in held.values()):
        return "(nothing to compare: run with --linear int16)"
    pack_linear_layers(model, "onednn", device)
    packed = {m: m.weight for m in linears}
    for m in linears:
        m.unpack()
    plain = {m: m.weight for m in linears}

    def use(int16: bool) -> Callable[[], None]:
        def setup() -> None:
            for m in linears:
                m.weight, m.int16_weight = (plain[m], held[m]) if int16 else (packed[m], None)

        return setup

    variants = {"int16": use(True), "float32": use(False)}
    table = _ratio_table(engine, batches, variants, rounds, use(True))
    return (
        f"Decode step and linear layers alone (the output projection as configured in "
        f"both), medians of {rounds} each:\n\n" + table
    )


PREFILL_VARIANTS = ("native", "flash", "float32", "bfloat16", "auto")


def _prefill_setting(engine: LLMEngine, name: str) -> Callable[[], None]:
    """Sets the runner's prompt attention as `--prefill-attention name` would have (the
    fields it derives from that choice at start-up); "auto": back to what they are now."""
    runner = engine.runner
    started = (
        runner.prefill_in_place,
        runner.prefill_kernels,
        runner.prefill_dtype,
        runner.prompt_kernel_min_work,
    )

    def setup() -> None:
        if name == "auto":
            (
                runner.prefill_in_place,
                runner.prefill_kernels,
                runner.prefill_dtype,
                runner.prompt_kernel_min_work,
            ) = started
            return
        runner.prefill_in_place = name == "native"
        runner.prefill_kernels = runner.native if name == "flash" else None
        runner.prefill_dtype = torch.bfloat16 if name == "bfloat16" else None
        runner.prompt_kernel_min_work = 0

    return setup


def _prefill_shape(text: str) -> tuple[int, int, int]:
    """ "8x256" -> (8, 256, 0); "4x256+128" -> (4, 256, 128)."""
    shape, _, cached = text.partition("+")
    prompts, tokens = shape.split("x")
    return int(prompts), int(tokens), int(cached or 0)


def compare_prefill(
    engine: LLMEngine,
    shapes: Sequence[tuple[int, int, int]],
    variants: Sequence[str] = PREFILL_VARIANTS,
    rounds: int = 8,
) -> str:
    """Prompt steps with each prompt-attention path, alternating step by step in this one
    engine (so that all see the same moments of the machine): for each (prompts, tokens,
    cached) shape, `rounds` steps per variant of `prompts` fresh prompts of `tokens` new
    tokens, each behind the same `cached` tokens already in the prefix cache (a fresh
    opening per step, prefilled untimed just before). Median ms per step and its ratio to
    the first variant's."""
    runner = engine.runner
    restore = _prefill_setting(engine, "auto")
    bs = engine.info.block_size
    vocab = engine.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cfg = runner.model.config
    # the C paths need the runner's kernels; "flash" what the runner asks of it at start-up
    flash = (
        runner.kv_dtype in (torch.float32, torch.bfloat16)
        and runner.v_dtype == runner.kv_dtype
        and cfg.sliding_window is None
        and prefill_kernel_fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs)
    )
    usable = [
        v
        for v in variants
        if v not in ("native", "flash") or (runner.native is not None and (v == "native" or flash))
    ]
    lines = [
        "| prompts x tokens (+ cached) | "
        + " | ".join(f"{v} (ms)" for v in usable)
        + " | "
        + " | ".join(f"{v} / {usable[0]}" for v in usable[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(usable) - 1),
    ]
    try:
        for prompts, tokens, cached in shapes:
            if cached % bs:
                raise ValueError(f"cached tokens must be a multiple of the block size {bs}")
            g = torch.Generator().manual_seed(prompts * 10_000 + tokens + cached)
            times: dict[str, list[float]] = {v: [] for v in usable}
            for step in range(rounds + 1):  # the first round warms up: not counted
                for name in usable:
                    opening = torch.randint(100, vocab, (cached,), generator=g).tolist()
                    if cached:  # the opening's blocks into the prefix cache, untimed
                        engine.add_request(f"open-{step}-{name}", [*opening, 100], params)
                        while engine.scheduler.requests:
                            engine.step()
                    for i in range(prompts):
                        new = torch.randint(100, vocab, (tokens,), generator=g).tolist()
                        engine.add_request(f"cmp-{step}-{name}-{i}", opening + new, params)
                    (restore if name == "auto" else _prefill_setting(engine, name))()
                    t0 = time.perf_counter()
                    engine.step()
                    wall = (time.perf_counter() - t0) * 1000
                    stats = engine.last_stats
                    engine.abort(list(engine.scheduler.requests))
                    if stats is None or stats.num_prefill_tokens != prompts * tokens:
                        raise RuntimeError(
                            f"the step prefilled {stats and stats.num_prefill_tokens} of "
                            f"{prompts * tokens} new tokens (token budget, or the prefix cache "
                            "missed the opening)"
                        )
                    if step:
                        times[name].append(wall)
            med = {v: statistics.median(t) for v, t in times.items()}
            label = f"{prompts} x {tokens}" + (f" (+ {cached})" if cached else "")
            lines.append(
                f"| {label} | "
                + " | ".join(f"{med[v]:.1f}" for v in usable)
                + " | "
                + " | ".join(f"{med[v] / med[usable[0]]:.2f}x" for v in usable[1:])
                + " |"
            )
    finally:
        engine.abort(list(engine.scheduler.requests))
        restore()
    return (
        f"Prompt steps by prefill attention, medians of {rounds} alternating steps each:\n\n"
        + "\n".join(lines)
    )


CURVE_SIZES = (4, 8, 16, 32, 48, 64, 96, 128)


def batch_curve(engine: LLMEngine, rounds: int = 3) -> tuple[list[tuple[int, float]], int, int]:
    """Decode tok/s by batch size as `--tune-batch` measures it (worker.engine.tuning), each
    point the median of `rounds` sweeps; and the batch size the tuner would choose."""
    runner = engine.runner
    sweeps = [
        measure_curve(
            runner.execute_model, list(CURVE_SIZES), runner.info.num_blocks, runner.block_size
        )
        for _ in range(rounds)
    ]
    context = sweeps[0][1]
    curve = [(b, statistics.median(s[0][i][1] for s in sweeps)) for i, b in enumerate(CURVE_SIZES)]
    return curve, context, choose_batch(curve)


def curve_table(curve: list[tuple[int, float]], context: int, choice: int) -> str:
    lines = ["| batch | decode tok/s |", "|---:|---:|"]
    lines += [f"| {b} | {r:.0f} |" for b, r in curve]
    return "\n".join(lines) + (
        f"\n\n(contexts of {context} tokens; medians of 3 sweeps; `--tune-batch` would run "
        f"at most {choice} sequences: the smallest batch within 5% of the best rate.)"
    )


def plot_curve(curve: list[tuple[int, float]], choice: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([b for b, _ in curve], [r for _, r in curve], marker="o")
    ax.axvline(choice, color="#c66", linestyle="--", label=f"tuned cap: {choice}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per decode step")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("decode throughput by batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument(
        "--context", type=int, default=256, help="cached tokens per sequence in decode steps"
    )
    ap.add_argument("--attention", default="auto", choices=("auto", "native", "torch"))
    ap.add_argument("--linear", default="auto", choices=LINEAR_BACKENDS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--key-layout", default="auto", choices=KEY_LAYOUTS)
    ap.add_argument(
        "--compare-layer-ops",
        action="store_true",
        help="only time batch-64 decode steps with the C layer ops against the torch ops",
    )
    ap.add_argument(
        "--compare-linear",
        action="store_true",
        help="only time decode steps with packed linear weights against torch's plain matmul",
    )
    ap.add_argument(
        "--compare-layer-stack",
        action="store_true",
        help="only time decode steps with the layers as one run of C calls against layer by layer",
    )
    ap.add_argument(
        "--no-rows-kernel",
        action="store_true",
        help="drop the C row kernel's weights (the layer stack built again over oneDNN's "
        "matmuls), as where a large model leaves the linear layers to oneDNN",
    )
    ap.add_argument(
        "--compare-rows-kernel",
        action="store_true",
        help="only time decode steps with the linear layers through the C row kernel "
        "against oneDNN's packed matmul",
    )
    ap.add_argument(
        "--compare-int16",
        action="store_true",
        help="only time decode steps with int16 linear layers against float32 (oneDNN); "
        "with --linear int16",
    )
    ap.add_argument(
        "--prompts",
        default="",
        help="only profile prompt steps, e.g. 1x256,8x256 (prompts x tokens in one step)",
    )
    ap.add_argument(
        "--compare-prefill",
        default="",
        help="only time prompt steps with each prefill attention path, alternating, e.g. "
        "8x256,4x256+128 (prompts x new tokens, + tokens cached before them)",
    )
    ap.add_argument(
        "--separate-silu",
        action="store_true",
        help="int16 layers: SiLU and multiply as their own op before the down projection "
        "(rather than as it rounds its inputs), to compare in another process",
    )
    ap.add_argument(
        "--glibc-default-malloc",
        action="store_true",
        help="leave glibc's allocator as it starts (the engine otherwise keeps the memory a "
        "step frees), to compare in another process (--prompts prints page faults a step)",
    )
    ap.add_argument(
        "--torch-profiler",
        action="store_true",
        help="split the step under the torch profiler rather than with timers",
    )
    args = ap.parse_args()
    if args.separate_silu:
        NativeKernels.linear_i16_silu = _separate_silu  # type: ignore[method-assign]
    if args.glibc_default_malloc:
        runner_mod.keep_freed_memory = lambda: ""
    engine = LLMEngine(
        EngineConfig(
            dtype=args.dtype,
            max_num_seqs=64,
            attention=args.attention,
            linear=args.linear,
            kv_cache_dtype=args.kv_cache_dtype,
            key_layout=args.key_layout,
        )
    )
    if args.no_rows_kernel:
        drop_rows_kernel(engine)
        print("the row kernel's weights dropped: linear layers through oneDNN", file=sys.stderr)
    info = engine.info
    print(
        f"linear layers: {info.linear}; attention: {info.attention}; "
        f"KV cache: {info.kv_cache_dtype}; keys as {info.key_layout}",
        file=sys.stderr,
    )
    if args.compare_layer_ops:
        print(compare_layer_ops(engine))
        return
    if args.compare_prefill:
        print(compare_prefill(engine, [_prefill_shape(p) for p in args.compare_prefill.split(",")]))
        return
    if args.prompts:
        shapes = [tuple(int(v) for v in p.split("x")) for p in args.prompts.split(",")]
        prompt_rows = []
        for n, tokens in shapes:
            print(f"profiling prompt steps of {n} x {tokens} tokens", file=sys.stderr)
            prompt_rows.append(profile_prompt(engine, n, tokens))
            print(f"  {prompt_rows[-1].faults} minor page faults a step", file=sys.stderr)
        print(prompt_table(prompt_rows, limit_label(engine)))
        return
    batches = tuple(int(b) for b in args.batches.split(","))
    comparisons = {
        "compare_linear": compare_linear,
        "compare_int16": compare_int16,
        "compare_rows_kernel": compare_rows_kernel,
        "compare_layer_stack": compare_layer_stack,
    }
    for flag, compare in comparisons.items():
        if getattr(args, flag):
            print(compare(engine, batches))
            return
    rows = run(
        engine, batches, lambda m: print(m, file=sys.stderr), args.torch_profiler, args.context
    )
    print(table(rows, limit_label(engine)))


if __name__ == "__main__":
    main()
