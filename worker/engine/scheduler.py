"""Iteration-level scheduler: the batch is rebuilt at every step.

There are no prefill and decode phases. Each request has tokens (prompt + output so
far) and computed tokens (those whose K/V are in the cache); every step lets the
computed count catch up, under a token budget (`max_num_batched_tokens`) and a
sequence cap (`max_num_seqs`). A decode is "1 token to catch up", a prefill "many",
so a prefill is chunked whenever the budget runs out, and prefill chunks and decodes
share one forward pass.

schedule(), once per step:
  0. Requests past their deadline end now (a waiting one never starts).
  1. Running requests, in admission order, take what they need to catch up within the
     budget. When a request's new KV slots cannot be allocated, the policy's victim
     (lowest priority / newest) is preempted: its blocks are freed and it goes back to
     the waiting queue to be recomputed later, its generated tokens kept. If the victim
     is the request itself, it simply waits.
  2. Only if nothing was preempted: waiting requests are admitted in policy order while
     budget and sequence slots remain. Admission is a memory decision: a request joins
     only if blocks for its next chunk can be had (prefix-cache hits count as computed).
     The head of the queue not fitting stops admission for this step.
The mix of prefill and decode is a knob (`prefill_mix`): decode-first is the order
above; chunked caps the prompt tokens of a step at `prefill_budget`, so a long prompt
never stretches the gap between two tokens of the running requests; prefill-first
admits first, and the running requests' decodes sit out every step that admits one
(lower time to first token, longer gaps between tokens).
update(), after the forward pass: computed counts advance, sampled tokens are appended,
stop conditions checked; finished requests leave at once and free their blocks. The
tokens computed for each request are reported to the policy (fair sharing counts them).
Who waits in front and who is preempted is the policy's (worker/engine/policy.py,
worker/engine/fairness.py), never the mechanism's.

`static` scheduling (for comparison only): a batch is admitted only when the previous
one has fully finished, with KV reserved for each member's whole output.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from worker.config import EngineConfig
from worker.engine.fairness import FairPolicy
from worker.engine.kv_cache import KVCacheManager, cdiv
from worker.engine.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from worker.engine.policy import FCFSPolicy, Policy, PriorityPolicy
from worker.limits import check_prompt_fits
from worker.request import Request, RequestStatus


def make_policy(config: EngineConfig) -> Policy:
    """The policy `config.policy` names: fcfs, priority, or fair (between clients)."""
    if config.policy == "fcfs":
        return FCFSPolicy()
    if config.policy == "priority":
        return PriorityPolicy(config.aging_s)
    if config.policy == "fair":
        return FairPolicy(
            dict(config.client_weights),
            aging_s=config.aging_s,
            max_running=config.client_max_running,
        )
    raise ValueError(f"unknown policy {config.policy!r}; choose fcfs, priority or fair")


@dataclass
class _Step:
    """What one schedule() has handed out so far."""

    budget: int  # tokens left in this step
    prefill_left: int | None  # prompt tokens left (prefill_mix "chunked"), else None
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)

    def take(self, s: ScheduledRequest) -> None:
        self.scheduled[s.request_id] = s
        self.budget -= s.num_new_tokens
        if self.prefill_left is not None and not s.is_decode:
            self.prefill_left -= s.num_new_tokens

    def give_back(self, request_id: str) -> None:
        undone = self.scheduled.pop(request_id, None)
        if undone is not None:
            self.budget += undone.num_new_tokens
            if self.prefill_left is not None and not undone.is_decode:
                self.prefill_left += undone.num_new_tokens


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # A sequence can never hold more tokens than the whole cache.
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        self.policy = make_policy(config)
        # Running sequences at most: max_num_seqs, or less where the engine measured
        # that this machine serves a smaller batch as well (worker.engine.tuning).
        self.max_running = config.max_num_seqs
        self.running: list[Request] = []
        # Running requests that sit this step out (set by the engine's test hooks only).
        self.held: frozenset[str] = frozenset()
        self.requests: dict[str, Request] = {}
        self._deadlines: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()
        self.step_count = 0
        self.num_preemptions = 0

    # -- membership ----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if it can never run here."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.check_fits(req.num_prompt_tokens)
        req.seq = next(self._seq)
        self.requests[req.request_id] = req
        self.policy.add(req)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.seq, req))

    def check_fits(self, num_prompt_tokens: int) -> None:
        """ValueError unless a prompt this long can ever run (and leave room for a token)."""
        check_prompt_fits(num_prompt_tokens, self.max_model_len)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """End requests from outside the step (abort, stop string); frees their blocks now."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                outputs.append(self._finish(req, status))
        return outputs

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.step_count += 1
        finished = self._expire_deadlines(now)
        mix = self.config.prefill_mix
        step = _Step(
            budget=self.config.max_num_batched_tokens,
            prefill_left=self.config.prefill_budget if mix == "chunked" else None,
        )
        static = self.config.scheduling == "static"
        may_admit = not static or not self.running
        if mix == "prefill-first" and may_admit:
            # New prompts first; decodes sit out the steps that admit any.
            if self._admit(step, now):
                self._catch_up(step, decodes=False)
            else:
                self._catch_up(step)
        else:
            self._catch_up(step)
            if not step.preempted and may_admit:
                self._admit(step, now)

        items = list(step.scheduled.values())
        num_decode = sum(1 for s in items if s.is_decode)
        total = sum(s.num_new_tokens for s in items)
        return SchedulerOutput(
            step=self.step_count,
            scheduled=items,
            num_prefill_tokens=total - num_decode,
            num_decode_tokens=num_decode,
            preempted_ids=step.preempted,
            finished=finished,
        )

    def _catch_up(self, step: _Step, decodes: bool = True) -> None:
        """Step 1: running requests take what they need to catch up, in admission order;
        the policy's victim is preempted when KV blocks run out."""
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or step.budget == 0:
                continue
            if req.request_id in self.held or req.request_id in step.scheduled:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1 and not decodes:
                continue
            n = self._chunk(req, remaining, step)
            if n == 0:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.policy.victim(self.running)
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                step.give_back(victim.request_id)
                if victim is req:
                    break
            else:
                step.take(self._scheduled(req, n))

    def _admit(self, step: _Step, now: float) -> bool:
        """Step 2: waiting requests join in policy order while a sequence slot, the
        budget and KV blocks for their next chunk allow (static scheduling: a whole batch
        into an empty one, with KV reserved for each member's whole output). True if any
        joined."""
        static = self.config.scheduling == "static"
        reserved = 0
        admitted = False
        while len(self.running) < self.max_running:
            req = self.policy.peek()
            if req is None or (step.budget == 0 and not static) or step.prefill_left == 0:
                break
            if static:
                # Request-level batching reserves KV for the whole output up front.
                need = cdiv(
                    min(req.num_prompt_tokens + req.sampling_params.max_tokens, self.max_model_len),
                    self.config.block_size,
                )
                if reserved + need > self.kv.num_free_blocks:
                    break
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = self._chunk(req, req.num_tokens - num_hit, step)
            if not self.kv.allocate_slots(req, n, hits):
                break
            if static:
                reserved += need - cdiv(num_hit + n, self.config.block_size)
            self.policy.pop()
            self.kv.count_prefix_query(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.running.append(req)
            admitted = True
            if n > 0:
                step.take(self._scheduled(req, n))
        return admitted

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, end what has finished."""
        now = self.clock()
        outputs = []
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if s.is_decode:
                self.policy.served(req, 0, 1)
            else:
                self.policy.served(req, s.num_new_tokens, 0)
            token = result.sampled.get(s.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.all_token_ids.append(token)
            timing = req.timing
            if timing.first_token is None:
                timing.first_token = now
            timing.token_times.append(now)
            status, stop_reason = self._check_stop(req, token)
            out = EngineCoreOutput(
                s.request_id,
                [token],
                logprobs=result.logprobs.get(s.request_id),
                stop_reason=stop_reason,
                stopped_by_token=status == RequestStatus.FINISHED_STOPPED,
            )
            if status is not None:
                self._finish(req, status, now)
                out.finish_reason = status.finish_reason
            outputs.append(out)
        return outputs

    # -- helpers -------------------------------------------------------------------------

    def _chunk(self, req: Request, remaining: int, step: _Step) -> int:
        n = min(remaining, step.budget)
        cap = self.config.long_prefill_token_threshold
        if cap and n > 1:
            n = min(n, cap)
        if remaining > 1 and step.prefill_left is not None:
            n = min(n, step.prefill_left)  # chunked: prompt tokens share a budget per step
        return n

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids,
            start=req.num_computed_tokens,
            num_new_tokens=n,
            block_ids=self.kv.block_ids(req.request_id),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            eos_token_ids=req.eos_token_ids,
        )

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.policy.left(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.timing.preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(req)

    def _finish(
        self, req: Request, status: RequestStatus, now: float | None = None
    ) -> EngineCoreOutput:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.policy.left(req)
        else:
            self.policy.remove(req)
        self.kv.free(req)
        req.status = status
        if req.timing.finished is None:
            req.timing.finished = self.clock() if now is None else now
        del self.requests[req.request_id]
        return EngineCoreOutput(req.request_id, [], finish_reason=status.finish_reason)

    def _expire_deadlines(self, now: float) -> list[EngineCoreOutput]:
        outputs = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if not req.is_finished:
                outputs.append(self._finish(req, RequestStatus.FINISHED_DEADLINE, now))
        return outputs
