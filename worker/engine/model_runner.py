"""The model runner: owns the model, the KV tensors and the sampler.

execute_model turns a SchedulerOutput into flat tensors (tokens, positions, slot
mapping, attention metadata), runs one forward pass over the mixed batch, computes
logits only for the positions that sample, and samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from worker.config import CUDA_MEMORY_FRACTION, DEFAULT_CPU_KV_BYTES, EngineConfig
from worker.engine.decode_graphs import DecodeGraphs
from worker.engine.kv_cache import cdiv
from worker.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from worker.hardware import (
    advise_huge_pages,
    choose_int16_linear,
    choose_key_layout,
    choose_kv_dtype,
    choose_prefill_attention,
    detect_cores,
    keep_freed_memory,
    read_cpu_flags,
    resolve_device,
)
from worker.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    InPlaceDecode,
    PrefillChunk,
    Workspace,
    decode_mask,
    prefill_mask,
)
from worker.model.layer_stack import LayerStack
from worker.model.llama import Linear, LlamaForCausalLM
from worker.model.loader import DTYPE_NAMES, DTYPES, LoadedModel, activation_dtype, dtype_name
from worker.model.native import (
    KV_DTYPES,
    MAX_GROUP,
    NativeKernels,
    cache_row,
    load_native,
    prefill_kernel_fits,
)
from worker.model.packing import (
    attach_int16_weights,
    attach_rows_weights,
    int16_fits,
    pack_linear_layers,
)
from worker.model.quant import Int8Linear
from worker.model.sampler import Sampler, SamplingRow, greedy_only

# Decode groups: sequences sorted by context length are padded together; a group is
# split when padding would exceed this fraction of the useful work.
MAX_DECODE_PADDING = 0.25
MIN_DECODE_GROUP = 8


def cache_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """The keys' and the values' cache dtypes of a KV cache dtype's name
    (`worker.hardware.choose_kv_dtype`): a torch dtype's for both, "int8" (rows of D
    values and their float32 scales, `native.cache_row`) for both, or "bfloat16-int8",
    bfloat16 keys over int8 values."""
    if name == "bfloat16-int8":
        return torch.bfloat16, torch.int8
    dtype = torch.int8 if name == "int8" else DTYPES[name]
    return dtype, dtype


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts found at start-up (never written back into the config)."""

    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    device: str
    dtype: str
    kv_cache_bytes: int
    dtype_reason: str = ""
    num_threads: int = 1  # torch threads for steps of more than SMALL_STEP_TOKENS tokens
    attention: str = "torch"  # the decode attention path and why (for the start-up log)
    linear: str = "torch"  # the linear layers' matmul path and why (likewise)
    kv_cache_dtype: str = "float32"  # the KV cache's dtype and why (likewise)
    key_layout: str = "rows"  # a block of the keys' cache as rows or pairs, and why
    allocator: str = ""  # what was set of the C library's allocator (likewise)
    decode_graphs: str = "off"  # decode steps as CUDA graphs, or why not (likewise)


@dataclass
class StepInputs:
    """One step's flat batch, ready for the forward pass."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # the requests in flat-row order
    sampling: list[ScheduledRequest]  # requests that sample this step, in logit-row order
    logit_rows: torch.Tensor  # [S] flat rows whose hidden states give the logits


SMALL_STEP_TOKENS = 2  # CPU steps of at most this many tokens run on one thread ...
# ... where a step reads no more than this of weights: a larger model's step streams
# them, and two threads read faster than one. The default model (257 MB a step in
# bfloat16) decoded 1 and 2 sequences in 0.63x the time on both threads of an Intel Xeon
# with AMX (23.0 against 36.5 ms a step, alternating); a 2-layer model (13 MB) ran its
# 1-token steps no slower on one thread, and the idle one no longer spun a core away
# from the event loop, the broker and the database.
SMALL_MODEL_BYTES = 64 << 20


def step_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights a decode step reads: the decoder's linear layers and the output
    projection it computes the logits with (its narrow copy where there is one; the
    embedding table is read a few rows a step)."""

    def size(m: torch.nn.Module) -> int:
        if isinstance(m, Int8Linear):
            return m.in_features * m.out_features
        return m.weight.numel() * m.weight.element_size() if isinstance(m, Linear) else 0

    total = sum(size(m) for m in model.layers.modules())
    if model.narrow_head is not None:
        return total + size(model.narrow_head)
    head = model.output_weight  # tied: the embedding table, read whole for the logits
    return total + head.numel() * head.element_size()


def cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache [blocks, KV heads, block size, D], zeroed (padded
    attention reads unwritten slots: masked, but 0 * NaN is NaN). On CPU it asks for
    2 MB pages before the zeroing first touches it (`advise_huge_pages`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu":
        advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t.zero_()


# Auto's prompt kernel over keys in pairs (worker.hardware.choose_prefill_attention) takes
# a chunk where its attention has at least this many (query row, key) pairs; shorter
# chunks join the decode kernel's rows. Prompt steps on an AMD EPYC Zen 4 (`python
# ops/bench/step_profile.py --compare-prefill`, alternating, two runs), the kernel for
# every chunk against the rows: 32 x 32 tokens (528 pairs a prompt) 1.08-1.09x the time,
# 16 x 128 (8,256) 1.05-1.06x, 8 x 256 (32,896) 0.99-1.01x, 4 x 256 behind 128 cached
# (65,664) 0.97x, 2 x 1,024 0.88-0.89x, 1 x 2,048 0.79-0.80x: its calls, one a chunk and
# layer, cost about what they save below a few hundred rows.
PROMPT_KERNEL_MIN_WORK = 65_536


def prompt_kernel_work(num_new_tokens: int, num_context: int) -> int:
    """(query row, key) pairs a causal chunk's attention scores."""
    return num_new_tokens * num_context + num_new_tokens * (num_new_tokens + 1) // 2


class ModelRunner:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, dtype_reason: str = "as loaded"
    ) -> None:
        self.config = config
        self.model = loaded.model
        self.device = resolve_device(config.device)  # "cuda" -> "cuda:N"
        act_dtype = activation_dtype(loaded)  # float32 on CPU, whatever the linear layers'
        mcfg = loaded.config
        self.sliding_window = mcfg.sliding_window
        self.block_size = config.block_size
        cpu = self.device.type == "cpu"
        self.native, attention = self._attention_backend(
            config, act_dtype, mcfg.num_heads // mcfg.num_kv_heads
        )
        # The layer's per-token ops in C where the attention kernel is (the same library),
        # for a float32 residual stream (what those kernels take); each step's metadata
        # carries them where the model's layers take them (decided here, once).
        self.layer_ops = self.native if act_dtype == torch.float32 else None
        self._layers_take_ops = all(layer.takes_layer_ops for layer in self.model.layers)
        step_ops = self.step_ops
        # float32 layers as int16 products, through those ops; decided before the packing
        # for oneDNN, which they replace. lanes: the kernel's build, 0 where these layers
        # cannot take it
        lanes = step_ops.int16_lanes if step_ops is not None else 0
        lanes = lanes if int16_fits(self.model, lanes) else 0
        int16 = choose_int16_linear(
            config.linear, loaded.auto_dtype, dtype_name(loaded), read_cpu_flags(), lanes
        )
        packing = "torch" if int16 is not None else config.linear
        linear = pack_linear_layers(self.model, packing, self.device.type)
        done = attach_int16_weights(self.model, lanes if int16 is not None else 0)
        if int16 is not None:
            linear = f"{done} ({int16.reason})"
        # decode steps and short prompt chunks: the linear layers through the C row
        # kernel (worker.model.llama.ROWS_KERNEL_MAX), whose weights' copy is made here
        row_kernel = attach_rows_weights(self.model, step_ops)
        if step_ops is not None and int16 is None:
            linear += f"; {row_kernel}"
        linear_kind = "int16" if int16 is not None else dtype_name(loaded)
        kv = choose_kv_dtype(
            config.kv_cache_dtype,
            self.device.type,
            DTYPE_NAMES[act_dtype],
            linear_kind,
            self.native is not None,
            read_cpu_flags(),
            prompts_read_cache=config.prefill_attention in ("flash", "native"),
        )
        # the keys' cache and the values' (int8 rows hold D values and their float32
        # scales: quantize_rows); "bfloat16-int8" is bfloat16 keys over int8 values
        self.kv_dtype, self.v_dtype = cache_dtypes(kv.dtype)
        prompt_kernel = (
            self.native is not None
            and kv.dtype in ("float32", "bfloat16")
            and mcfg.sliding_window is None
        )
        shapes = (mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, self.block_size)
        # the prompt kernel over keys in pairs (bfloat16 products), where built for this CPU
        prompt_pairs = (
            prompt_kernel
            and self.native is not None
            and self.native.prefill_pairs_built
            and kv.dtype == "bfloat16"
            and prefill_kernel_fits(*shapes, pairs=True)
        )
        prefill = choose_prefill_attention(
            config.prefill_attention,
            self.device.type,
            linear_kind,
            read_cpu_flags(),
            in_place=self.native is not None,
            kv_dtype=kv.dtype,
            prompt_kernel=prompt_kernel and prefill_kernel_fits(*shapes),
            prompt_pairs=prompt_pairs,
            key_layout=config.key_layout,
        )
        # None where SDPA takes q, k and v as they are (CUDA; float32 on CPU)
        self.prefill_dtype = DTYPES[prefill.dtype] if prefill.dtype == "bfloat16" else None
        # auto's prompt kernel over keys in pairs takes the chunks of at least this much
        # attention (`prompt_kernel_work`), the decode kernel's rows the shorter ones
        # (PROMPT_KERNEL_MIN_WORK); 0: every chunk
        auto_pairs = (
            config.prefill_attention == "auto" and prefill.dtype == "flash" and prompt_pairs
        )
        self.prompt_kernel_min_work = PROMPT_KERNEL_MIN_WORK if auto_pairs else 0
        # prompt chunks' rows attended by the C kernel with the decode rows (`_in_place`)
        self.prefill_in_place = prefill.dtype == "native" or auto_pairs
        # prompt chunks attended by the C prompt kernel, each through its block table
        self.prefill_kernels = self.native if prefill.dtype == "flash" else None
        # a block of bfloat16 keys as rows, or as pairs of dimensions (native.key_pairs)
        layout = choose_key_layout(
            config.key_layout,
            self.device.type,
            kv.dtype,
            in_place_decode=self.native is not None,
            prefill_attention=prefill.dtype,
            cpu_flags=read_cpu_flags(),
            group=mcfg.num_heads // mcfg.num_kv_heads,
            block_size=self.block_size,
            prompt_pairs=prompt_pairs,
        )
        k_row = cache_row(self.kv_dtype, mcfg.head_dim, keys=True)
        v_row = cache_row(self.v_dtype, mcfg.head_dim, keys=False)
        # bytes of K and V for one block across all layers
        token_bytes = k_row * self.kv_dtype.itemsize + v_row * self.v_dtype.itemsize
        block_bytes = mcfg.num_layers * self.block_size * mcfg.num_kv_heads * token_bytes
        num_blocks = config.num_kv_blocks or max(1, self._kv_budget(config) // block_bytes)
        self.num_kv_heads = mcfg.num_kv_heads
        graphs, graphs_reason = self._graphs_mode(config)
        # Head-major blocks (worker.model.attention explains why); decode graphs' padding
        # rows write into one more, past the pool's (`DecodeGraphs`)
        cache_blocks = num_blocks + (graphs is not None)
        blocks = (cache_blocks, mcfg.num_kv_heads, self.block_size)
        k_shape = (
            (cache_blocks, mcfg.num_kv_heads, mcfg.head_dim // 2, self.block_size, 2)
            if layout.dtype == "pairs"
            else (*blocks, k_row)
        )
        self.kv_caches = [
            (
                cache_tensor(k_shape, self.kv_dtype, self.device),
                cache_tensor((*blocks, v_row), self.v_dtype, self.device),
            )
            for _ in range(mcfg.num_layers)
        ]
        self.workspace = Workspace(self.device)
        self._slots = num_blocks * self.block_size
        # steps whose every row the C kernels take: the decoder's layers as one run of C
        # calls (worker.model.layer_stack), the per-op path's kernels without its Python
        self.layer_stack: LayerStack | None = None
        no_stack = self.build_layer_stack()
        # CPU: a step of one or two tokens of a small model runs no faster on several
        # OpenMP threads, but the idle ones spin between kernels and take a core from the
        # event loop, the broker and the database sharing the machine; such steps run on
        # one thread (SMALL_MODEL_BYTES).
        self._threads = (config.num_threads or detect_cores()) if cpu else 1
        # steps of at most this many tokens run on one thread (none for a large model)
        small_model = step_weight_bytes(self.model) <= SMALL_MODEL_BYTES
        self._small_step_tokens = SMALL_STEP_TOKENS if small_model else 0
        allocator = ""
        if cpu:
            torch.set_num_threads(self._threads)
            allocator = keep_freed_memory()
        # A step whose rows all pick greedily takes their tokens from the model without
        # the whole logits where it can (LlamaForCausalLM.greedy_tokens); off, it takes
        # the logits and the sampler as any other step (the tests compare the two).
        self.greedy_shortcut = True
        # greedy picks by the C kernels' argmax where they are built (CPU)
        self.sampler = Sampler(
            self.device,
            seed=0,
            row_argmax=self.native.argmax_rows if self.native is not None else None,
        )
        max_len = min(
            config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        self.decode_graphs = (
            DecodeGraphs(
                self.model,
                self.kv_caches,
                block_size=self.block_size,
                scratch_block=num_blocks,
                max_batch=config.max_num_seqs,
                max_model_len=max_len,
                sliding_window=self.sliding_window,
                device=self.device,
                capture=graphs == "capture",
            )
            if graphs is not None
            else None
        )
        self.info = RuntimeInfo(
            model_name=loaded.name,
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_model_len=max_len,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            vocab_size=mcfg.vocab_size,
            device=str(self.device),
            dtype=dtype_name(loaded),
            kv_cache_bytes=num_blocks * block_bytes,
            dtype_reason=dtype_reason,
            num_threads=self._threads,
            attention=attention
            + ("; norms, rotary and SiLU as C layer ops" if self.step_ops else "")
            + (
                f"; {self.layer_stack.describe()}"
                if self.layer_stack is not None
                else f"; layers one by one ({no_stack})"
                if step_ops is not None
                else ""
            )
            + {
                "native": f"; prefill attention native, in place ({prefill.reason})",
                "flash": f"; prefill attention by the C prompt kernel, in place ({prefill.reason})",
            }.get(prefill.dtype, f"; prefill attention in {prefill.dtype} ({prefill.reason})"),
            kv_cache_dtype=f"{kv.dtype} ({kv.reason})",
            key_layout=f"{layout.dtype} ({layout.reason})",
            allocator=allocator,
            linear=linear,
            decode_graphs=self.decode_graphs.describe()
            if self.decode_graphs is not None
            else f"off ({graphs_reason})",
        )

    def _attention_backend(
        self, config: EngineConfig, act_dtype: torch.dtype, group: int
    ) -> tuple[NativeKernels | None, str]:
        """The C decode kernel where it applies and builds, else the torch path; and why."""
        if config.attention == "torch":
            return None, "torch (set explicitly)"
        if self.device.type != "cpu":
            return None, f"torch (the C kernel is for CPU, not {self.device.type})"
        why = (
            f"activations in {act_dtype}"
            if act_dtype not in KV_DTYPES
            else f"{group} query heads per KV head, more than {MAX_GROUP}"
            if group > MAX_GROUP
            else None
        )
        if why is not None:
            if config.attention == "native":
                raise ValueError(f"attention 'native' does not apply: {why}")
            return None, f"torch (the C kernel does not apply: {why})"
        loaded = load_native()
        if loaded.kernels is None:
            if config.attention == "native":
                raise ValueError(f"attention 'native' is not available: {loaded.reason}")
            return None, f"torch ({loaded.reason})"
        return loaded.kernels, f"native, in place ({loaded.reason})"

    def _graphs_mode(self, config: EngineConfig) -> tuple[str | None, str]:
        """Whether decode steps go through `DecodeGraphs`: "capture" (CUDA graphs),
        "eager" (their fixed shapes, uncaptured) or None; and why."""
        if config.decode_graphs == "off":
            return None, "set explicitly"
        if config.decode_graphs == "eager":
            if self.native is not None:
                raise ValueError(
                    "decode_graphs 'eager' runs the torch attention path, not the C kernel: "
                    "set attention 'torch'"
                )
            return "eager", "set explicitly"
        if self.device.type != "cuda":
            return None, f"CUDA graphs are for CUDA, not {self.device.type}"
        return "capture", "auto: CUDA"

    @property
    def cache_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The keys' cache dtype and the values'."""
        return self.kv_dtype, self.v_dtype

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_bytes is not None:
            return config.kv_cache_bytes
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * CUDA_MEMORY_FRACTION)
        return DEFAULT_CPU_KV_BYTES

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        if self._threads > 1:
            tokens = sum(s.num_new_tokens for s in sched.scheduled)
            want = 1 if tokens <= self._small_step_tokens else self._threads
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        step = self._graph_step(sched.scheduled)
        logits: torch.Tensor | None
        if step is not None:
            (logits, sampling), picked = step, None
        else:
            logits, picked, sampling = self._eager_pick(sched.scheduled)
        if self.device.type == "cuda":  # the forward's time, not its launches'
            torch.cuda.synchronize(self.device)
        if not sampling:
            return ModelRunnerOutput({}, {}, time.perf_counter() - t0, 0.0)
        t1 = time.perf_counter()
        if picked is not None:  # greedy rows' tokens, taken without the logits
            ids: list[int] = picked.tolist()
            sampled = {s.request_id: t for s, t in zip(sampling, ids, strict=True)}
            return ModelRunnerOutput(sampled, {}, t1 - t0, time.perf_counter() - t1)
        assert logits is not None
        out = self.sampler(logits, [_sampling_row(s) for s in sampling])
        sampled = {s.request_id: t for s, t in zip(sampling, out.token_ids, strict=True)}
        logprobs = {
            s.request_id: lp for s, lp in zip(sampling, out.logprobs, strict=True) if lp is not None
        }
        return ModelRunnerOutput(sampled, logprobs, t1 - t0, time.perf_counter() - t1)

    def _graph_step(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, list[ScheduledRequest]] | None:
        """A decode-only step through the decode graphs: logits [n, V] of its rows, all of
        which sample, and the rows; None where the graphs do not take the step."""
        graphs = self.decode_graphs
        key = None if graphs is None else graphs.key(scheduled)
        if key is None:
            return None
        assert graphs is not None
        logits = graphs.run(scheduled, key)  # [n, V], the members' order (all sample)
        return None if logits is None else (logits, scheduled)

    def _eager_step(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """A step op by op: logits [S, V] of the rows that sample (None where none does)
        and those rows."""
        hidden, ops, sampling = self._eager_forward(scheduled)
        return (None if hidden is None else self.model.compute_logits(hidden, ops)), sampling

    def _eager_pick(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[ScheduledRequest]]:
        """_eager_step, or, where every row that samples picks greedily and the model can
        pick without the whole logits (greedy_tokens), their tokens [S] in the logits'
        place: (logits, tokens, rows), one of the two None (both where no row samples)."""
        hidden, ops, sampling = self._eager_forward(scheduled)
        if hidden is None:
            return None, None, []
        if (
            self.greedy_shortcut
            and self.model.picks_greedily(ops)
            and all(greedy_only(s.sampling_params, _output_index(s)) for s in sampling)
        ):
            return None, self.model.greedy_tokens(hidden, ops), sampling
        return self.model.compute_logits(hidden, ops), None, sampling

    def _eager_forward(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, NativeKernels | None, list[ScheduledRequest]]:
        """The forward pass op by op: the final hidden states [S, C] of the rows that
        sample (None where none does), the step's C layer ops, and those rows."""
        inp = self._prepare(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)  # [T, C]
        if not inp.sampling:
            return None, inp.meta.layer_ops, []
        return hidden.index_select(0, inp.logit_rows), inp.meta.layer_ops, inp.sampling

    @torch.inference_mode()
    def all_logits(self, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """Diagnostics: one forward pass; logits [n, V] of every token each request computes
        (the output projection through the step's C ops, as `execute_model` runs it)."""
        inp = self._prepare(scheduled)
        logits = self.model.compute_logits(
            self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta), inp.meta.layer_ops
        )
        out, row = {}, 0
        for s in inp.order:
            out[s.request_id] = logits[row : row + s.num_new_tokens]
            row += s.num_new_tokens
        return out

    def _joins_in_place(self, s: ScheduledRequest) -> bool:
        """Whether a prompt chunk's rows are attended by the decode kernel with the decode
        rows: where prefill attention is "native", or is auto's prompt kernel and the
        chunk too short for it (`prompt_kernel_work`)."""
        if not self.prefill_in_place:
            return False
        if self.prefill_kernels is None:
            return True
        return prompt_kernel_work(s.num_new_tokens, s.start) < self.prompt_kernel_min_work

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """Flatten the batch: single-token rows first (sorted by context), then chunks,
        those whose rows join the decode kernel's first (`_joins_in_place`)."""
        bs = self.block_size
        singles = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.start)
        chunks = [s for s in scheduled if s.num_new_tokens > 1]
        # chunks joining the decode rows in place first: those rows are one run from row 0
        joins = [self._joins_in_place(s) for s in chunks]
        joining = [s for s, j in zip(chunks, joins, strict=True) if j]
        chunks = joining + [s for s, j in zip(chunks, joins, strict=True) if not j]
        order = singles + chunks
        n_single = len(singles)

        ids: list[int] = [s.token_ids[s.start] for s in singles]
        pos: list[int] = [s.start for s in singles]
        slots: list[int] = [s.block_ids[s.start // bs] * bs + s.start % bs for s in singles]
        last_row: list[int] = list(range(n_single))
        prefills: list[PrefillChunk] = []
        row = n_single
        for i, s in enumerate(chunks):
            n, start = s.num_new_tokens, s.start
            ids.extend(s.token_ids[start : start + n])
            p = np.arange(start, start + n)
            blocks = np.asarray(s.block_ids[: cdiv(start + n, bs)], dtype=np.int64)
            pos.extend(p.tolist())
            slots.extend((blocks[p // bs] * bs + p % bs).tolist())
            row += n
            last_row.append(row - 1)
            if i < len(joining):  # the chunk's rows join the kernel's (`_in_place`)
                continue
            if self.prefill_kernels is not None:  # the chunk and its context read in place
                if not 0 <= blocks.min() <= blocks.max() < self.info.num_blocks:
                    # the kernel reads where the table says: a block past the cache is a bug
                    raise ValueError(f"blocks of {s.request_id!r} outside the cache")
                table = torch.from_numpy(blocks.astype(np.int32))
                prefills.append(PrefillChunk(row - n, row, start, None, None, table))
                continue
            prefills.append(
                PrefillChunk(
                    start=row - n,
                    end=row,
                    num_context=start,
                    gather_index=None if start == 0 else self._head_rows(blocks[None]),
                    mask=prefill_mask(start, n, self.sliding_window, self.device),
                )
            )

        dev = self.device
        if self.step_ops is not None and slots and not 0 <= min(slots) <= max(slots) < self._slots:
            # the C store writes where it is told: a slot past the cache is a bug upstream
            raise ValueError(f"cache slots {min(slots)}..{max(slots)} outside 0..{self._slots - 1}")
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        in_place = self._in_place(singles + joining)
        stack = self.layer_stack
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            slot_blocks=slot_mapping // bs,
            slot_offsets=slot_mapping % bs,
            decode_groups=[] if self.native is not None else self._decode_groups(singles),
            prefills=prefills,
            in_place=in_place,
            layer_ops=self.step_ops,
            prefill_dtype=self.prefill_dtype,
            prefill_kernels=self.prefill_kernels,
            block_size=bs,
            workspace=self.workspace,
            layer_stack=stack
            if stack is not None and stack.takes(len(ids), in_place, prefills)
            else None,
        )
        sampling = [i for i, s in enumerate(order) if s.samples]
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            meta=meta,
            order=order,
            sampling=[order[i] for i in sampling],
            logit_rows=torch.tensor([last_row[i] for i in sampling], dtype=torch.int64, device=dev),
        )

    def build_layer_stack(self) -> str | None:
        """Build the layer stack over what the model's layers hold now (at start-up, and
        again after their weights were repacked or their row kernel copies dropped: the
        stack built before steps aside from such layers rather than take them). Returns
        why there is none, or None."""
        step_ops = self.step_ops
        no_stack = LayerStack.fits(self.model, step_ops)
        self.layer_stack = (
            LayerStack(self.model, step_ops, self.kv_caches, self.block_size)
            if no_stack is None and step_ops is not None
            else None
        )
        return no_stack

    @property
    def step_ops(self) -> NativeKernels | None:
        """The C layer ops a step hands the model (None where its layers do not take them)."""
        return self.layer_ops if self._layers_take_ops else None

    def _in_place(self, members: list[ScheduledRequest]) -> InPlaceDecode | None:
        """The C kernel's rows: each member's new tokens in flat-row order, each row
        seeing the keys up to its own position (a decode token its whole context, a
        prompt chunk's row its context and the chunk up to itself: causal), through its
        sequence's block table repeated per row. None without the kernel or rows."""
        if self.native is None or not members:
            return None
        ends, table = self._block_table(members, np.int32)
        lens = np.asarray(ends, dtype=np.int32)  # [n]: a row each (decode-only steps)
        counts = np.asarray([s.num_new_tokens for s in members])
        rows = int(counts.sum())
        if rows > len(members):  # prompt chunks: a row per new token
            # a member's row sees the member's end less the member's rows after it
            after = np.cumsum(counts).repeat(counts) - np.arange(1, rows + 1)
            lens = (lens.repeat(counts) - after).astype(np.int32)
            table = table.repeat(counts, axis=0)
        return InPlaceDecode(
            kernels=self.native,
            block_tables=torch.from_numpy(table),  # [T, nb]
            context_lens=torch.from_numpy(lens),  # [T]
            window=self.sliding_window or 0,
        )

    def _block_table(
        self, members: list[ScheduledRequest], dtype: type[np.integer]
    ) -> tuple[list[int], np.ndarray]:
        """Keys each member's last new row sees (its context and its new tokens) and the
        block tables [n, max blocks] that hold them; a short row repeats its last block
        (any valid block: the keys past its length are masked or never read)."""
        bs = self.block_size
        ctx = [s.start + s.num_new_tokens for s in members]
        table = np.empty((len(members), cdiv(max(ctx), bs)), dtype=dtype)
        for r, s in enumerate(members):
            used = cdiv(ctx[r], bs)
            table[r, :used] = s.block_ids[:used]
            table[r, used:] = s.block_ids[used - 1]
        return ctx, table

    def _decode_groups(self, singles: list[ScheduledRequest]) -> list[DecodeGroup]:
        """Split length-sorted single-token rows into groups with bounded padding."""
        bs = self.block_size
        groups: list[DecodeGroup] = []
        start = 0
        useful = 0
        for i, s in enumerate(singles):
            blocks_i = cdiv(s.start + 1, bs)
            size = i - start
            if size >= MIN_DECODE_GROUP and blocks_i * (size + 1) > (1 + MAX_DECODE_PADDING) * (
                useful + blocks_i
            ):
                groups.append(self._decode_group(singles, start, i))
                start, useful = i, 0
            useful += blocks_i
        if start < len(singles):
            groups.append(self._decode_group(singles, start, len(singles)))
        return groups

    def _decode_group(self, singles: list[ScheduledRequest], start: int, end: int) -> DecodeGroup:
        bs = self.block_size
        ctx, table = self._block_table(singles[start:end], np.int64)
        nb = table.shape[1]
        lens = torch.tensor(ctx, dtype=torch.int64, device=self.device)
        return DecodeGroup(
            start=start,
            end=end,
            gather_index=self._head_rows(table),
            num_blocks=nb,
            mask=decode_mask(lens, nb * bs, self.sliding_window),
        )

    def _head_rows(self, table: np.ndarray) -> torch.Tensor:
        """Block table [n, nb] -> cache rows block * KVH + head, ordered (n, head, block):
        [n * KVH * nb] int64 on the device."""
        kvh = self.num_kv_heads
        rows = table[:, None, :] * kvh + np.arange(kvh, dtype=np.int64)[None, :, None]
        return torch.from_numpy(rows.reshape(-1)).to(self.device)


def _output_index(s: ScheduledRequest) -> int:
    """Tokens the request has generated so far (0 for its first)."""
    return len(s.token_ids) - s.num_prompt_tokens


def _sampling_row(s: ScheduledRequest) -> SamplingRow:
    p = s.sampling_params
    out_index = _output_index(s)
    if p.needs_penalties:
        prompt, output = s.token_ids[: s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens :]
    else:
        prompt, output = (), ()
    banned: tuple[int, ...] = ()
    if out_index < p.min_tokens:
        banned = p.stop_token_ids + (() if p.ignore_eos else s.eos_token_ids)
    return SamplingRow(
        params=p,
        output_index=out_index,
        prompt_token_ids=prompt,
        output_token_ids=output,
        min_tokens_stop_ids=banned,
    )
