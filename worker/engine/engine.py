"""The engine: one step = schedule -> run the model -> update -> outputs.

Synchronous and single-threaded; `worker.engine.async_engine` runs it in its own
thread for asyncio callers, `worker.batch` drives it directly.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.config import EngineConfig
from worker.engine.faults import TestHooks
from worker.engine.model_runner import ModelRunner, RuntimeInfo
from worker.engine.output_processor import OutputProcessor
from worker.engine.outputs import RequestOutput, SchedulerOutput, StepStats
from worker.engine.scheduler import Scheduler
from worker.engine.steplog import StepLog
from worker.engine.tuning import OperatingPoint, tune
from worker.hardware import (
    DtypeChoice,
    choose_dtype,
    choose_output_head,
    read_cpu_flags,
    read_cpu_vendor,
)
from worker.limits import RequestLimits
from worker.model.loader import LoadedModel, dtype_name, load_model
from worker.request import Request, RequestStatus, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """How much more work the engine can place now (the queue consumer pulls by this)."""

    free_blocks: int
    total_blocks: int
    block_size: int
    running: int
    waiting: int
    free_seqs: int  # sequence slots not taken by running or waiting requests
    waiting_tokens: int  # prompt tokens of waiting requests, not yet in the cache
    kv_usage: float

    @property
    def free_tokens(self) -> int:
        """KV slots left once the waiting requests' prompts are placed."""
        return max(0, self.free_blocks * self.block_size - self.waiting_tokens)

    def can_admit(self, num_prompt_tokens: int, reserve_blocks: int = 0) -> bool:
        """A free sequence slot and KV room for this prompt plus a reserve of blocks."""
        need = num_prompt_tokens + reserve_blocks * self.block_size
        return self.free_seqs > 0 and self.free_tokens >= need


class LLMEngine:
    """Continuous-batching engine over one model."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if loaded is None:
            choice = choose_dtype(
                config.dtype,
                config.device,
                read_cpu_flags(),
                cuda_bf16=config.device != "cpu" and torch.cuda.is_bf16_supported(),
                cpu_vendor=read_cpu_vendor(),
            )
            head = choose_output_head(config.dtype, choice.dtype, config.device)
            loaded = load_model(
                config.model,
                choice.dtype,
                config.device,
                max_positions=config.max_model_len,
                cache_dir=config.cache_dir,
                head_dtype=head.dtype,
            )
            loaded = dataclasses.replace(loaded, auto_dtype=config.dtype == "auto")
            if loaded.model.narrow_head is not None:  # too small a model keeps float32's
                choice = DtypeChoice(
                    choice.dtype, f"{choice.reason}; output projection: {head.reason}"
                )
        else:
            choice = DtypeChoice(dtype_name(loaded), "the dtype of the model passed in")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(config, loaded, choice.reason)
        self.info: RuntimeInfo = self.runner.info
        log.info(
            "dtype %s (%s); %d threads; linear layers: %s; attention: %s; KV cache: %s, "
            "keys as %s%s; decode graphs: %s",
            self.info.dtype,
            choice.reason,
            self.info.num_threads,
            self.info.linear,
            self.info.attention,
            self.info.kv_cache_dtype,
            self.info.key_layout,
            f"; {self.info.allocator}" if self.info.allocator else "",
            self.info.decode_graphs,
        )
        self.scheduler = Scheduler(config, self.info.num_blocks, self.info.max_model_len)
        self.operating_point: OperatingPoint | None = None
        if config.tune_batch:
            self.operating_point = tune(self.runner, config.max_num_seqs)
            self.scheduler.max_running = self.operating_point.max_running
            log.info("tuned: %s", self.operating_point.describe())
        self.limits = RequestLimits(
            self.info.vocab_size, self.scheduler.max_model_len, config.max_tokens_cap
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_stats: StepStats | None = None
        self.recent_stats: collections.deque[StepStats] = collections.deque(maxlen=4096)
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self.hooks = TestHooks.from_env()
        self.step_log = StepLog.from_env()

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
        client: str = "default",
    ) -> Request:
        """Queue a tokenized request; ValueError (nothing queued) if it cannot be served.
        `client` is who it is accounted to (the fair policy shares service by client)."""
        self.validate(prompt_token_ids, params)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            deadline=deadline,
            eos_token_ids=self.info.eos_token_ids,
            client=client,
        )
        self.scheduler.add_request(req)
        self.output_processor.add(req)
        return req

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request cannot be served."""
        self.limits.validate(prompt_token_ids, params)

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """End requests now (finish reason 'abort'); their blocks are freed at once."""
        core = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs, _ = self.output_processor.process(core, time.time())
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def capacity(self) -> Capacity:
        s = self.scheduler
        waiting_tokens = sum(r.num_tokens for r in s.policy)
        return Capacity(
            free_blocks=s.kv.num_free_blocks,
            total_blocks=self.info.num_blocks,
            block_size=self.info.block_size,
            running=s.num_running,
            waiting=s.num_waiting,
            free_seqs=max(0, self.scheduler.max_running - s.num_running - s.num_waiting),
            waiting_tokens=waiting_tokens,
            kv_usage=s.kv.usage,
        )

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of every request that changed."""
        if self.hooks is not None:
            self.scheduler.held = self.hooks.held(self.scheduler.running)
        t0 = time.perf_counter()
        started = time.time()
        sched = self.scheduler.schedule()
        if self.hooks is not None:
            self.hooks.check_crash(self.scheduler.requests[s.request_id] for s in sched.scheduled)
        client_tokens = self._client_tokens(sched)
        if self.step_log is not None:
            self.step_log.write(sched, self.scheduler)
        core = list(sched.finished)
        forward_s = sample_s = 0.0
        sampled = 0
        if not sched.is_empty:
            result = self.runner.execute_model(sched)
            forward_s, sample_s = result.forward_time_s, result.sample_time_s
            sampled = len(result.sampled)
            core += self.scheduler.update(sched, result)
        outputs, stopped = self.output_processor.process(core, time.time())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        stats = StepStats(
            step=sched.step,
            started_at=started,
            batch_size=len(sched.scheduled),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_sampled=sampled,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(sched.preempted_ids),
            kv_usage=self.scheduler.kv.usage,
            step_time_s=time.perf_counter() - t0,
            forward_time_s=forward_s,
            sample_time_s=sample_s,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_queries_total=self.scheduler.kv.prefix_queries,
            prefix_hits_total=self.scheduler.kv.prefix_hits,
            client_tokens=client_tokens,
        )
        self.last_stats = stats
        self.recent_stats.append(stats)
        for listener in self.stats_listeners:
            listener(stats)
        return outputs

    def _client_tokens(self, sched: SchedulerOutput) -> dict[str, tuple[int, int]]:
        """(prompt tokens, generated tokens) per client in this step."""
        out: dict[str, tuple[int, int]] = {}
        requests = self.scheduler.requests
        for s in sched.scheduled:
            client = requests[s.request_id].client
            prompt, generated = out.get(client, (0, 0))
            if s.is_decode:
                out[client] = (prompt, generated + 1)
            else:
                out[client] = (prompt + s.num_new_tokens, generated)
        return out

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run token prompts to completion (for tests and scripts); results in input order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
