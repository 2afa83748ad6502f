"""Decode steps as CUDA graphs: a step's kernels launched as one.

A decode step of a small model on a GPU is bound by its launches, not by its arithmetic:
the torch path runs ~60 computing ops a layer (norms, rotary, the K/V store, the blocks'
gather, two batched matmuls and a softmax, the MLP, residual adds), 1,792 in a batch-16
decode step of the default model (torch profiler), each a kernel launch on a GPU. With
the arithmetic made negligible (its 30 layers at width 64) such a step took 25.8 ms of
host time on one core of an AMD EPYC Zen 4, ~14 us an op: a ceiling of a few thousand
tokens a second whatever the GPU. A CUDA graph records a step's launches once and
replays them with one call.

A graph replays fixed shapes and fixed addresses, so a step is padded to a bucket:
- batch: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs;
- context: the blocks a row's keys span, a power of two up to MAX_GRAPH_TOKENS' worth
  (the gather reads whole padded contexts, so at most twice the useful keys).
Steps past either (or with prompt tokens) take the eager path. Each (batch, blocks)
bucket's graph is captured on first use, all into one memory pool and writing one logits
buffer (replays never overlap: a step reads its logits before the next one starts), and
its first replay is checked against the same step run op by op; a bucket whose capture
or check fails runs op by op, and so does every bucket not captured by then.

The step's inputs are copied into static buffers, one host-to-device copy of a packed
int64 array a step: token ids, positions, cache slots, context lengths and block tables
[batch, blocks]. Inside the graph the gather rows (block * KVH + head) and the mask come
from the tables and lengths, as `ModelRunner._decode_groups` builds them on the host for
one group. Padding rows read token 0 at position 0, write their K/V into a scratch block
no sequence holds (the runner allocates one past the pool's) and attend to that block.

The same fixed-shape steps run without capture where asked ("eager"): on CPU, with the
torch attention path, the tests check them against the op-by-op steps and replay each
bucket's step traced once by make_fx, the CPU's stand-in for a capture
(tests/model/test_decode_graphs.py); on a GPU they tell a capture's fault from the fixed
shapes' own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from worker.engine.kv_cache import cdiv
from worker.engine.outputs import ScheduledRequest
from worker.model.attention import AttentionMetadata, DecodeGroup, Workspace, decode_mask
from worker.model.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

# Contexts (in tokens) past which decode steps run eagerly: the gather's scratch grows with
# batch x padded context, and at long contexts the step's own work outweighs its launches.
MAX_GRAPH_TOKENS = 4096
# Fields of the packed inputs before the block tables: ids, positions, slots, lengths.
_FIELDS = 4


def batch_bucket(n: int) -> int:
    """The batch a step of `n` rows is padded to: 1, 2, 4, 8, then multiples of 8."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return cdiv(n, 8) * 8


def blocks_bucket(n: int) -> int:
    """The blocks a context spanning `n` blocks is padded to: a power of two."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphKey:
    batch: int  # rows, padding included
    blocks: int  # blocks of each row's table, padding included


@dataclass
class GraphStats:
    """What the graphs did, for the start-up facts and the benchmarks."""

    captured: int = 0  # graphs captured (eager mode: shapes built)
    replays: int = 0  # steps run through a graph
    eager_steps: int = 0  # decode steps past the buckets, run by the eager path
    failed: str | None = None  # why a capture failed (buckets not captured run eagerly)
    capture_s: float = 0.0  # seconds spent capturing (in the steps that captured)
    keys: list[GraphKey] = field(default_factory=list)  # buckets, in the order first used

    def describe(self) -> str:
        out = (
            f"{self.captured} captured in {self.capture_s:.1f} s, {self.replays} steps "
            f"replayed, {self.eager_steps} eager"
        )
        return out + (f"; capture failed: {self.failed}" if self.failed else "")


class _RetainingWorkspace(Workspace):
    """A Workspace that keeps every buffer it ever handed out: a graph captured over a
    buffer keeps its address, so a larger bucket's capture must not free it by growing."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._retired: list[torch.Tensor] = []

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        old = self._buffers.get(name)
        out = super().get(name, rows, cols, dtype)
        if old is not None and self._buffers[name] is not old:
            self._retired.append(old)
        return out


class DecodeGraphs:
    """Decode-only steps of up to `max_batch` rows through fixed-shape forward passes,
    each captured as a CUDA graph (`capture`) or run as it is. `scratch_block` is a cache
    block past the pool's, written only by padding rows."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        *,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_model_len: int,
        sliding_window: int | None,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_batch = batch_bucket(max_batch)
        self.max_blocks = blocks_bucket(cdiv(min(max_model_len, MAX_GRAPH_TOKENS), block_size))
        self.window = sliding_window
        self.device = device
        self.capture = capture
        self.num_kv_heads = kv_caches[0][0].shape[1]
        self.stats = GraphStats()
        # the packed inputs of the largest bucket, on the device; each bucket's views are
        # taken at the same offsets every step (`_views`)
        size = self.max_batch * (_FIELDS + self.max_blocks)
        self._inputs = torch.zeros(size, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._heads = torch.arange(self.num_kv_heads, dtype=torch.int64, device=device)
        self._workspace = _RetainingWorkspace(device)
        # a bucket's graph (None: its fixed shapes run uncaptured, "eager")
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph | None] = {}
        # every graph's logits [max_batch, V] float32, made at the first capture: one
        # buffer rather than one per graph (up to ~100 of 12.6 MB at batch 64 here)
        self._logits: torch.Tensor | None = None
        if capture:
            with torch.cuda.device(device):
                self._pool = torch.cuda.graph_pool_handle()
                # warm-up and capture on a stream of the model's device: a capture records
                # only its own stream's work, and torch's default capture stream is the
                # current device's (the wrong one for "cuda:1" where 0 is current)
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def describe(self) -> str:
        how = (
            "CUDA graphs, a graph per bucket captured on first use"
            if self.capture
            else "fixed-shape steps without capture (eager)"
        )
        return (
            f"decode steps of up to {self.max_batch} sequences and "
            f"{self.max_blocks * self.block_size} tokens as {how}"
        )

    def key(self, members: list[ScheduledRequest]) -> GraphKey | None:
        """The bucket of a step of these rows, or None where it is not one the graphs take:
        prompt tokens (or a row that does not sample: one token of a prompt's middle),
        too many rows, too long a context, or a bucket not captured after a capture
        failed (the graphs captured before it still replay)."""
        if not members or any(s.num_new_tokens != 1 or not s.samples for s in members):
            return None
        blocks = cdiv(max(s.start for s in members) + 1, self.block_size)
        key = GraphKey(batch_bucket(len(members)), blocks_bucket(blocks))
        if (
            len(members) > self.max_batch
            or blocks > self.max_blocks
            or (self.stats.failed is not None and key not in self._graphs)
        ):
            self.stats.eager_steps += 1
            return None
        return key

    def run(self, members: list[ScheduledRequest], key: GraphKey) -> torch.Tensor | None:
        """Logits [n, V] float32 of the members' next tokens, in their order (a view of the
        graphs' output: read it before the next step), or None where this bucket's capture
        failed (the step then takes the eager path)."""
        self._fill(members, key)
        n = len(members)
        if key not in self._graphs:
            if self.capture:
                return self._capture(key, n)
            self._graphs[key] = None
            self.stats.keys.append(key)
            self.stats.captured += 1
        graph = self._graphs[key]
        self.stats.replays += 1
        if graph is None:
            return self._forward(key)[:n]
        assert self._logits is not None
        with torch.cuda.device(self.device):
            graph.replay()
        return self._logits[:n]

    def _views(self, key: GraphKey) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots, lengths [B] and tables [B, NB] of a bucket: views into
        the packed device inputs, the same ones every step."""
        B, NB = key.batch, key.blocks
        flat = self._inputs[: B * (_FIELDS + NB)]
        ids, pos, slots, lens = flat[: _FIELDS * B].view(_FIELDS, B)
        return ids, pos, slots, lens, flat[_FIELDS * B :].view(B, NB)

    def _fill(self, members: list[ScheduledRequest], key: GraphKey) -> None:
        """The members' inputs, padded to the bucket, into the static buffers: one copy."""
        B, NB, bs, n = key.batch, key.blocks, self.block_size, len(members)
        host = self._host[: B * (_FIELDS + NB)].numpy()
        fields = host[: _FIELDS * B].reshape(_FIELDS, B)
        tables = host[_FIELDS * B :].reshape(B, NB)
        fields[0] = 0  # padding rows: token 0 at position 0, its K/V in the scratch block
        fields[1] = 0
        fields[2] = self.scratch_block * bs
        fields[3] = 1
        tables[:] = self.scratch_block  # keys past a row's length are masked: any block
        for r, s in enumerate(members):
            start = s.start
            fields[0, r] = s.token_ids[start]
            fields[1, r] = start
            fields[2, r] = s.block_ids[start // bs] * bs + start % bs
            fields[3, r] = start + 1
            used = cdiv(start + 1, bs)
            tables[r, :used] = s.block_ids[:used]
        if n and not (
            fields[2, :n].min() >= 0
            and fields[2, :n].max() < self.scratch_block * bs
            and tables[:n].min() >= 0
            and tables[:n].max() <= self.scratch_block
        ):
            # the graph reads and writes where the tables and slots say: past the pool's
            # blocks is a bug upstream, and on a GPU a fatal fault
            raise ValueError("a decode row's blocks lie outside the cache")
        self._inputs[: host.size].copy_(self._host[: host.size], non_blocking=True)

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The bucket's step from the static buffers: logits [B, V] float32."""
        ids, pos, slots, lens, tables = self._views(key)
        kvh, bs = self.num_kv_heads, self.block_size
        # cache rows block * KVH + head, ordered (row, head, block): [B * KVH * NB]
        rows = (tables[:, None, :] * kvh + self._heads[None, :, None]).reshape(-1)
        group = DecodeGroup(
            0, key.batch, rows, key.blocks, decode_mask(lens, key.blocks * bs, self.window)
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            slot_blocks=slots // bs,
            slot_offsets=slots % bs,
            decode_groups=[group],
            prefills=[],
            in_place=None,
            block_size=bs,
            workspace=self._workspace,
        )
        hidden = self.model(ids, pos, self.kv_caches, meta)  # [B, C]
        return self.model.compute_logits(hidden)

    def _capture(self, key: GraphKey, n: int) -> torch.Tensor | None:
        """Capture the bucket's graph over the static buffers as they stand (this step's
        inputs), check its first replay against the same step run op by op, and return
        this step's logits [n, V]; None where capture or the check failed (logged with
        its cause; the step then runs op by op, writing its K/V again, and so does every
        later step of a bucket not captured yet)."""
        B, t0 = key.batch, time.perf_counter()
        self.stats.keys.append(key)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device):
                current = torch.cuda.current_stream()
                self._stream.wait_stream(current)
                with torch.cuda.stream(self._stream):
                    # the step op by op first: lazy initialisation (cuBLAS's handles and
                    # workspaces) outside the capture, and the reference for the check
                    ref = self._forward(key)
                    if self._logits is None:
                        self._logits = torch.empty(
                            (self.max_batch, ref.shape[1]), dtype=ref.dtype, device=self.device
                        )
                    out = self._logits[:B]
                    # torch.cuda.graph would also empty the allocator's cache at each capture
                    graph.capture_begin(pool=self._pool)
                    try:
                        out.copy_(self._forward(key))
                    except BaseException:
                        with contextlib.suppress(Exception):  # the cause is the first error
                            graph.capture_end()
                        raise
                    graph.capture_end()
                current.wait_stream(self._stream)
                out.fill_(float("nan"))  # an empty graph would leave the buffer as it was
                graph.replay()
                if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
                    worst = (out - ref).abs().nan_to_num(float("inf")).max().item()
                    raise RuntimeError(
                        f"the first replay's logits differ from the same step op by op "
                        f"(largest difference {worst:.3g})"
                    )
        except Exception as e:  # any capture fault: this bucket's steps run op by op
            self.stats.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.warning(
                "decode graphs: capturing %s failed (%s); its steps run op by op",
                key,
                self.stats.failed,
                exc_info=True,
            )
            return None
        finally:
            self.stats.capture_s += time.perf_counter() - t0
        self._graphs[key] = graph
        self.stats.captured += 1
        self.stats.replays += 1
        return out[:n]
