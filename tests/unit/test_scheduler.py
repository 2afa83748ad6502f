"""The scheduler, driven without a model.

A fake runner stands in for the model: the token sampled at position p of request r is
a fixed function of (r, p), so what each request must produce is known independently of
batching, chunking and preemption. The fake runner also keeps a fake KV cache: every
computed position writes a digest of the request's tokens up to it into its slot, and
every chunk checks that the slots of all positions before it hold the right digests, so
a wrong block table or a false prefix-cache hit is caught.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.config import EngineConfig
from worker.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from worker.engine.policy import PriorityPolicy
from worker.engine.scheduler import Scheduler
from worker.request import FinishReason, Request, RequestStatus, SamplingParams

EOS = 2
TokenFn = Callable[[str, int], int]


def fake_token(rid: str, pos: int) -> int:
    """The fake model's choice at position pos of request rid (never EOS or < 100)."""
    return 100 + zlib.crc32(f"{rid}:{pos}".encode()) % 900


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_config(**kw) -> EngineConfig:
    base = {"max_num_seqs": 64, "max_num_batched_tokens": 64, "block_size": 4}
    base.update(kw)
    return EngineConfig(**base)


def make_req(
    rid: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 8,
    arrival: float = 0.0,
    priority: int = 0,
    deadline: float | None = None,
    eos: tuple[int, ...] = (EOS,),
    **params,
) -> Request:
    if isinstance(prompt, int):  # a distinct prompt of this length
        prompt = [10 + (zlib.crc32(f"{rid}/{i}".encode()) % 80) for i in range(prompt)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=arrival,
        priority=priority,
        deadline=deadline,
        eos_token_ids=eos,
    )


def expected_alone(req: Request, max_model_len: int, token_fn: TokenFn = fake_token):
    """The output tokens and finish reason of req run on its own (reference semantics)."""
    p = req.sampling_params
    n_prompt = req.num_prompt_tokens
    out: list[int] = []
    while True:
        tok = token_fn(req.request_id, n_prompt + len(out))
        out.append(tok)
        n = len(out)
        if n >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return out, FinishReason.STOP
            if tok in p.stop_token_ids:
                return out, FinishReason.STOP
        if n >= p.max_tokens or n_prompt + n >= max_model_len:
            return out, FinishReason.LENGTH


def _digests(tokens: list[int]) -> list[int]:
    """digests[p] stands for the K/V of position p: it depends on tokens[: p + 1]."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@dataclass
class Sim:
    """Drives a Scheduler with the fake runner and checks invariants at every step."""

    sched: Scheduler
    token_fn: TokenFn = fake_token
    reqs: dict[str, Request] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)
    admitted_at: dict[str, int] = field(default_factory=dict)  # first step scheduled
    slots: dict[tuple[int, int], int] = field(default_factory=dict)  # the fake KV cache

    @property
    def cfg(self) -> EngineConfig:
        return self.sched.config

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        self.reqs[req.request_id] = req
        self.tokens[req.request_id] = []
        return req

    def abort(self, *rids: str) -> list[EngineCoreOutput]:
        outs = self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        self._record(outs)
        return outs

    def step(self) -> SchedulerOutput:
        s = self.sched
        running_before = {r.request_id for r in s.running}
        so = s.schedule()
        self.history.append(so)
        self._check_schedule(so, running_before)
        self._fake_forward(so)
        sampled = {
            x.request_id: self.token_fn(x.request_id, len(x.token_ids))
            for x in so.scheduled
            if x.samples
        }
        outs = s.update(so, ModelRunnerOutput(sampled, {}, 0.0, 0.0))
        for o in outs:
            assert o.new_token_ids == [sampled[o.request_id]]
        self._record(list(so.finished) + outs)
        self.check_blocks()
        return so

    def run(self, max_steps: int = 2000) -> int:
        n = 0
        while self.sched.has_unfinished():
            self.step()
            n += 1
            assert n <= max_steps, "the scheduler did not finish its work"
        return n

    def ids(self, so: SchedulerOutput) -> list[str]:
        return [x.request_id for x in so.scheduled]

    def finish_reason(self, rid: str) -> FinishReason | None:
        outs = self.finals.get(rid)
        return outs[-1].finish_reason if outs else None

    # -- checks ----------------------------------------------------------------------------

    def _record(self, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            assert self.finish_reason(o.request_id) is None, f"{o.request_id} output after finish"
            self.tokens[o.request_id].extend(o.new_token_ids)
            self.finals.setdefault(o.request_id, []).append(o)
            if o.finished:
                req = self.reqs[o.request_id]
                assert req.is_finished and req.status.finish_reason == o.finish_reason
                assert o.request_id not in self.sched.requests

    def _check_schedule(self, so: SchedulerOutput, running_before: set[str]) -> None:
        s, cfg = self.sched, self.cfg
        ids = self.ids(so)
        running_before = running_before - {o.request_id for o in so.finished}
        assert len(ids) == len(set(ids))
        assert so.total_tokens == sum(x.num_new_tokens for x in so.scheduled)
        assert so.total_tokens <= cfg.max_num_batched_tokens
        assert len(so.scheduled) <= cfg.max_num_seqs
        assert s.num_running <= cfg.max_num_seqs
        assert not set(so.preempted_ids) & set(ids)
        now = s.clock()
        for x in so.scheduled:
            req = self.reqs[x.request_id]
            assert req.status == RequestStatus.RUNNING and req in s.running
            assert x.start == req.num_computed_tokens
            assert x.num_new_tokens >= 1 and x.start + x.num_new_tokens <= len(x.token_ids)
            if cfg.long_prefill_token_threshold:
                assert x.num_new_tokens <= max(1, cfg.long_prefill_token_threshold)
            assert req.deadline is None or now < req.deadline
            self.admitted_at.setdefault(x.request_id, so.step)
        for rid in so.preempted_ids:
            assert self.reqs[rid].status == RequestStatus.PREEMPTED
            assert s.kv.block_ids(rid) == []
        admitted = {r.request_id for r in s.running} - running_before
        if admitted and cfg.prefill_mix != "prefill-first":
            # Admission comes after every running request had its turn.
            assert not so.preempted_ids
            left_out = running_before - set(ids) - set(so.preempted_ids)
            assert not {r for r in left_out if r in s.requests}, "a running request starved"
        if cfg.scheduling == "static":
            assert not admitted or not running_before, "static admitted into a live batch"
            assert not so.preempted_ids, "static batching reserves KV: it never preempts"

    def _fake_forward(self, so: SchedulerOutput) -> None:
        bs = self.cfg.block_size
        digests = {x.request_id: _digests(list(x.token_ids)) for x in so.scheduled}
        # Like the real attention: every layer writes this step's K/V first, then reads.
        for x in so.scheduled:
            assert len(x.block_ids) * bs >= x.start + x.num_new_tokens
            d = digests[x.request_id]
            for p in range(x.start, x.start + x.num_new_tokens):
                self.slots[(x.block_ids[p // bs], p % bs)] = d[p]
        for x in so.scheduled:
            d = digests[x.request_id]
            for p in range(x.start + x.num_new_tokens):
                got = self.slots.get((x.block_ids[p // bs], p % bs))
                assert got == d[p], f"{x.request_id}: wrong K/V at position {p}"

    def check_blocks(self) -> None:
        """Every block's ref count is the number of block tables holding it."""
        kv = self.sched.kv
        owners = [0] * kv.pool.num_blocks
        for req in self.sched.running:
            for b in kv.block_ids(req.request_id):
                owners[b] += 1
        for rid, req in self.reqs.items():
            if req.status != RequestStatus.RUNNING:
                assert kv.block_ids(rid) == []
        assert [b.ref_cnt for b in kv.pool.blocks] == owners
        assert kv.num_free_blocks == owners.count(0)

    def check_drained(self) -> None:
        s = self.sched
        assert not s.has_unfinished() and s.num_running == 0 and s.num_waiting == 0
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
        assert s.kv.usage == 0.0
        for rid in self.reqs:
            assert self.finish_reason(rid) is not None, f"{rid} never finished"


def make_sim(num_blocks: int = 64, max_model_len: int = 1024, clock=None, **cfg) -> Sim:
    kw = {} if clock is None else {"clock": clock}
    return Sim(Scheduler(make_config(**cfg), num_blocks, max_model_len, **kw))


# -- budgets and order ------------------------------------------------------------------


def test_single_request_runs_to_max_tokens_with_the_fake_models_tokens():
    sim = make_sim()
    r = sim.add(make_req("a", 5, max_tokens=6))
    steps = sim.run()
    assert steps == 6
    assert sim.tokens["a"] == expected_alone(r, 1024)[0] == r.output_token_ids
    assert sim.finish_reason("a") == FinishReason.LENGTH
    first = sim.history[0].scheduled[0]
    assert (first.start, first.num_new_tokens, first.is_decode) == (0, 5, False)
    assert all(so.scheduled[0].is_decode for so in sim.history[1:])
    assert r.timing.first_scheduled is not None and r.timing.finished is not None
    assert len(r.timing.token_times) == 6
    sim.check_drained()


def test_chunked_prefill_of_a_long_prompt_under_a_small_budget():
    sim = make_sim(max_num_batched_tokens=16)
    r = sim.add(make_req("a", 50, max_tokens=3))
    chunks = []
    for _ in range(4):
        so = sim.step()
        (x,) = so.scheduled
        # (token_ids is a live view: after update it also holds the sampled token)
        chunks.append((x.start, x.num_new_tokens, r.num_output_tokens))
    assert chunks == [(0, 16, 0), (16, 16, 0), (32, 16, 0), (48, 2, 1)]
    assert r.timing.first_token is not None
    sim.run()
    assert sim.tokens["a"] == expected_alone(r, 1024)[0]
    sim.check_drained()


def test_long_prefill_threshold_caps_a_chunk():
    sim = make_sim(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sim.add(make_req("a", 20, max_tokens=2))
    sim.add(make_req("b", 3, max_tokens=2))
    so = sim.step()
    assert [(x.request_id, x.num_new_tokens) for x in so.scheduled] == [("a", 8), ("b", 3)]
    sim.run()
    sim.check_drained()


def test_decodes_are_scheduled_before_new_prefills():
    sim = make_sim(max_num_batched_tokens=8)
    sim.add(make_req("a", 3, max_tokens=10))
    sim.add(make_req("b", 3, max_tokens=10))
    sim.step()
    sim.add(make_req("c", 20, max_tokens=2))
    so = sim.step()
    assert sim.ids(so) == ["a", "b", "c"]
    a, b, c = so.scheduled
    assert a.is_decode and b.is_decode and not c.is_decode
    assert c.num_new_tokens == 6  # what the two decodes left of the budget
    assert (so.num_decode_tokens, so.num_prefill_tokens) == (2, 6)
    sim.run()
    sim.check_drained()


def test_budget_and_sequence_caps_hold_under_load():
    sim = make_sim(max_num_batched_tokens=7, max_num_seqs=3, num_blocks=200)
    reqs = [sim.add(make_req(f"r{i}", 2 + 3 * i, max_tokens=4 + i)) for i in range(8)]
    sim.run()  # Sim checks the caps at every step
    assert max(len(so.scheduled) for so in sim.history) == 3
    assert max(so.total_tokens for so in sim.history) == 7
    for r in reqs:
        assert sim.tokens[r.request_id] == expected_alone(r, 1024)[0]
    sim.check_drained()


def test_max_num_seqs_keeps_later_requests_waiting():
    sim = make_sim(max_num_seqs=2)
    for i in range(3):
        sim.add(make_req(f"r{i}", 4, max_tokens=3 + i))
    so = sim.step()
    assert sim.ids(so) == ["r0", "r1"] and sim.sched.num_waiting == 1
    sim.step()
    sim.step()  # r0 finishes here (3 tokens)
    so = sim.step()
    assert sim.ids(so) == ["r1", "r2"]
    sim.run()
    sim.check_drained()


# -- admission and batching mode -------------------------------------------------------


def test_admission_waits_for_blocks_and_resumes_when_they_are_freed():
    sim = make_sim(num_blocks=3, enable_prefix_caching=False)
    sim.add(make_req("a", 7, max_tokens=1))  # 2 blocks
    sim.add(make_req("b", 7, max_tokens=1))  # 2 more: only 1 left
    so = sim.step()
    assert sim.ids(so) == ["a"] and sim.sched.num_waiting == 1
    assert sim.finish_reason("a") == FinishReason.LENGTH
    assert sim.sched.kv.num_free_blocks == 3  # freed at the step it finished
    so = sim.step()
    assert sim.ids(so) == ["b"]
    sim.check_drained()


def test_head_of_queue_that_does_not_fit_blocks_admission():
    sim = make_sim(num_blocks=4, enable_prefix_caching=False)
    sim.add(make_req("a", 8, max_tokens=1))  # 2 blocks
    sim.add(make_req("b", 12, max_tokens=1))  # 3 blocks: does not fit now
    sim.add(make_req("c", 5, max_tokens=1))  # 2 blocks: would fit, but stays behind b
    so = sim.step()
    assert sim.ids(so) == ["a"]
    assert sim.ids(sim.step()) == ["b"]
    assert sim.ids(sim.step()) == ["c"]
    sim.check_drained()


def test_continuous_batching_admits_a_new_request_at_the_next_step():
    sim = make_sim()
    sim.add(make_req("a", 4, max_tokens=10))
    sim.step()
    sim.step()
    sim.add(make_req("b", 4, max_tokens=2))
    so = sim.step()
    assert sim.ids(so) == ["a", "b"]
    assert sim.reqs["a"].status == RequestStatus.RUNNING
    sim.run()
    sim.check_drained()


def test_static_batching_waits_for_the_whole_batch():
    sim = make_sim(scheduling="static")
    a = sim.add(make_req("a", 4, max_tokens=2))
    b = sim.add(make_req("b", 4, max_tokens=6))
    sim.step()
    c = sim.add(make_req("c", 4, max_tokens=2))
    sim.run()
    # a finished at step 2, b at step 6; c only starts once b has left.
    assert sim.admitted_at == {"a": 1, "b": 1, "c": 7}
    assert a.timing.finished is not None and b.timing.finished is not None
    for r in (a, b, c):
        assert sim.tokens[r.request_id] == expected_alone(r, 1024)[0]
    sim.check_drained()


def test_static_batching_reserves_kv_for_the_whole_output():
    # Each request needs cdiv(4 + 8, 4) = 3 blocks by its end; 5 blocks hold one batch
    # member at a time, although both prompts would fit now.
    sim = make_sim(num_blocks=5, scheduling="static", enable_prefix_caching=False)
    sim.add(make_req("a", 4, max_tokens=8))
    sim.add(make_req("b", 4, max_tokens=8))
    sim.run()
    assert sim.admitted_at == {"a": 1, "b": 9}
    assert sim.sched.num_preemptions == 0
    sim.check_drained()


# -- preemption ----------------------------------------------------------------------------


def test_preempted_requests_resume_with_identical_output():
    sim = make_sim(num_blocks=6, enable_prefix_caching=False)
    reqs = [sim.add(make_req(f"r{i}", 4, max_tokens=12, arrival=float(i))) for i in range(3)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert any(r.timing.preemptions > 0 for r in reqs)
    assert sum(r.timing.preemptions for r in reqs) == sim.sched.num_preemptions
    for r in reqs:
        # Alone in a big cache the same request gives the same tokens.
        alone = make_sim()
        ref = alone.add(make_req(r.request_id, r.prompt_token_ids, max_tokens=12))
        alone.run()
        assert sim.tokens[r.request_id] == alone.tokens[ref.request_id]
        assert sim.tokens[r.request_id] == expected_alone(r, 1024)[0]
        assert sim.finish_reason(r.request_id) == FinishReason.LENGTH
    sim.check_drained()


def test_preemption_keeps_generated_tokens_and_recomputes_them():
    sim = make_sim(num_blocks=2, enable_prefix_caching=False)
    a = sim.add(make_req("a", 3, max_tokens=10, arrival=0.0))
    b = sim.add(make_req("b", 3, max_tokens=10, arrival=1.0))
    sim.step()
    sim.step()
    assert a.num_tokens == b.num_tokens == 5
    kept = b.output_token_ids
    so = sim.step()  # a needs a second block: the newest (b) goes
    assert so.preempted_ids == ["b"] and sim.ids(so) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == kept and b.timing.preemptions == 1
    sim.run()
    # b was recomputed from scratch (prompt + kept outputs) in one chunk.
    resumed = next(x for so in sim.history[3:] for x in so.scheduled if x.request_id == "b")
    assert (resumed.start, resumed.num_new_tokens) == (0, 5)
    assert sim.tokens["b"][:2] == kept
    assert sim.tokens["b"] == expected_alone(b, sim.sched.max_model_len)[0]
    assert sim.tokens["a"] == expected_alone(a, sim.sched.max_model_len)[0]
    sim.check_drained()


def test_fcfs_preempts_the_newest_running_request():
    sim = make_sim(num_blocks=2, enable_prefix_caching=False)
    sim.add(make_req("old", 3, max_tokens=10, arrival=0.0))
    sim.add(make_req("new", 3, max_tokens=10, arrival=1.0))
    sim.step()
    sim.step()
    so = sim.step()
    assert so.preempted_ids == ["new"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_later_added_of_two_requests_with_equal_arrival_is_preempted(policy):
    # Arrival times tie often: `kvflow run-batch` gives every item the same one, and
    # AMQP timestamps have whole-second resolution. "Newest" must still mean the later.
    sim = make_sim(num_blocks=2, enable_prefix_caching=False, policy=policy)
    sim.add(make_req("first", 3, max_tokens=10, arrival=5.0))
    sim.add(make_req("second", 3, max_tokens=10, arrival=5.0))
    sim.step()
    sim.step()
    so = sim.step()
    assert so.preempted_ids == ["second"]
    assert sim.ids(so) == ["first"]


def test_equal_arrival_times_do_not_livelock_preemption():
    # Found by the random workload test: with tied arrivals the victim is the first
    # running request, the two requests take turns preempting each other while they
    # recompute in small chunks, and neither ever finishes.
    cfg = {"block_size": 2, "max_num_batched_tokens": 2, "max_num_seqs": 2}
    sim = make_sim(
        num_blocks=3,
        max_model_len=6,
        enable_prefix_caching=False,
        long_prefill_token_threshold=1,
        **cfg,
    )
    a = sim.add(make_req("a", [10], max_tokens=5, arrival=0.0))
    b = sim.add(make_req("b", [10], max_tokens=5, arrival=0.0))
    sim.run(max_steps=100)
    assert sim.tokens["a"] == expected_alone(a, 6)[0]
    assert sim.tokens["b"] == expected_alone(b, 6)[0]
    sim.check_drained()


def test_priority_preempts_the_lowest_priority_request():
    sim = make_sim(num_blocks=2, enable_prefix_caching=False, policy="priority", aging_s=0)
    sim.add(make_req("low", 3, max_tokens=10, arrival=0.0, priority=1))
    sim.add(make_req("high", 3, max_tokens=10, arrival=1.0, priority=0))
    so = sim.step()
    assert sim.ids(so) == ["high", "low"]
    sim.step()
    so = sim.step()
    assert so.preempted_ids == ["low"] and sim.ids(so) == ["high"]
    sim.run()
    sim.check_drained()


def test_priority_requeue_puts_a_preempted_request_before_newer_work_of_its_rank():
    # Policy.requeue: "it resumes before newer work of its rank". Here 'b' and 'c' have
    # the same priority and arrival time; 'b' was queued (and admitted) before 'c'.
    sim = make_sim(
        num_blocks=2, enable_prefix_caching=False, policy="priority", aging_s=0, max_num_seqs=2
    )
    sim.add(make_req("a", 3, max_tokens=3, arrival=0.0))
    sim.add(make_req("b", 3, max_tokens=10, arrival=1.0))
    sim.add(make_req("c", 3, max_tokens=10, arrival=1.0))
    assert sim.ids(sim.step()) == ["a", "b"]
    sim.step()
    so = sim.step()
    assert so.preempted_ids == ["b"]
    assert sim.finish_reason("a") == FinishReason.LENGTH
    so = sim.step()
    assert sim.ids(so) == ["b"], "c overtook the preempted b"


# -- policies --------------------------------------------------------------------------------


def _admission_order(sim: Sim) -> list[str]:
    sim.run()
    return sorted(sim.admitted_at, key=lambda rid: sim.admitted_at[rid])


def test_priority_order_with_equal_arrival():
    sim = make_sim(policy="priority", max_num_seqs=1)
    for rid, prio in [("p3", 3), ("p1", 1), ("p2", 2), ("p0", 0)]:
        sim.add(make_req(rid, 3, max_tokens=1, priority=prio, arrival=7.0))
    assert _admission_order(sim) == ["p0", "p1", "p2", "p3"]
    sim.check_drained()


@pytest.mark.parametrize("aging_s", [0.0, 30.0])
def test_fcfs_among_equal_priorities(aging_s):
    sim = make_sim(policy="priority", aging_s=aging_s, max_num_seqs=1)
    for rid, arrival in [("t2", 2.0), ("t0", 0.0), ("t3", 3.0), ("t1", 1.0)]:
        sim.add(make_req(rid, 3, max_tokens=1, arrival=arrival))
    assert _admission_order(sim) == ["t0", "t1", "t2", "t3"]


def test_fcfs_policy_serves_in_arrival_order():
    sim = make_sim(max_num_seqs=1)
    for i in range(4):
        sim.add(make_req(f"r{i}", 3, max_tokens=2, priority=3 - i, arrival=float(i)))
    assert _admission_order(sim) == ["r0", "r1", "r2", "r3"]


def test_aging_lets_old_low_priority_work_overtake_newer_high_priority_work():
    # aging_s=10: priority 2 arriving at t=0 queues as if it had arrived at t=20.
    def order(aging_s: float) -> list[str]:
        sim = make_sim(policy="priority", aging_s=aging_s, max_num_seqs=1)
        sim.add(make_req("high_t25", 3, max_tokens=1, priority=0, arrival=25.0))
        sim.add(make_req("low_t0", 3, max_tokens=1, priority=2, arrival=0.0))
        sim.add(make_req("high_t15", 3, max_tokens=1, priority=0, arrival=15.0))
        return _admission_order(sim)

    assert order(10.0) == ["high_t15", "low_t0", "high_t25"]
    assert order(0.0) == ["high_t15", "high_t25", "low_t0"]


def test_priority_policy_key_and_victim():
    pol = PriorityPolicy(aging_s=10.0)
    low = make_req("low", 2, priority=2, arrival=0.0)
    high = make_req("high", 2, priority=0, arrival=19.0)
    assert pol.key(low) > pol.key(high)
    assert pol.victim([low, high]) is low
    late = make_req("late", 2, priority=0, arrival=21.0)
    assert pol.victim([low, late]) is late


def test_priority_policy_remove_and_len():
    pol = PriorityPolicy()
    rs = [make_req(f"r{i}", 2, priority=i % 2, arrival=float(i)) for i in range(4)]
    for r in rs:
        pol.add(r)
    assert len(pol) == 4 and [r.request_id for r in pol] == ["r0", "r2", "r1", "r3"]
    assert pol.remove(rs[0]) and not pol.remove(rs[0])
    assert len(pol) == 3 and pol.peek() is rs[2]
    assert pol.pop() is rs[2] and len(pol) == 2
    assert [r.request_id for r in pol] == ["r1", "r3"]


# -- abort and deadline ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_of_waiting_and_running_requests_frees_everything(policy):
    sim = make_sim(num_blocks=8, max_num_seqs=2, policy=policy)
    sim.add(make_req("a", 9, max_tokens=20))
    sim.add(make_req("b", 9, max_tokens=20))
    sim.add(make_req("w", 9, max_tokens=20))
    sim.step()
    sim.step()
    assert sim.sched.kv.num_free_blocks < 8 and sim.sched.num_waiting == 1
    outs = sim.abort("a", "w", "nope")
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        ("a", FinishReason.ABORT),
        ("w", FinishReason.ABORT),
    ]
    assert sim.sched.num_waiting == 0 and sim.sched.num_running == 1
    assert sim.sched.kv.block_ids("a") == []
    sim.check_blocks()
    assert sim.abort("a") == []  # already gone
    so = sim.step()
    assert sim.ids(so) == ["b"]
    sim.abort("b")
    sim.check_drained()
    assert "w" not in sim.admitted_at


def test_waiting_request_past_its_deadline_is_never_started():
    clock = Clock(0.0)
    sim = make_sim(clock=clock, max_num_seqs=1)
    sim.add(make_req("busy", 4, max_tokens=5))
    late = sim.add(make_req("late", 4, max_tokens=5, deadline=2.0))
    for t in range(5):
        clock.t = float(t)
        so = sim.step()
        if t == 2:
            assert [(o.request_id, o.finish_reason) for o in so.finished] == [
                ("late", FinishReason.DEADLINE)
            ]
    sim.run()
    assert sim.finish_reason("late") == FinishReason.DEADLINE
    assert late.status == RequestStatus.FINISHED_DEADLINE
    assert "late" not in sim.admitted_at and late.timing.first_scheduled is None
    assert sim.tokens["late"] == []
    assert sim.finish_reason("busy") == FinishReason.LENGTH
    sim.check_drained()


def test_request_already_past_its_deadline_is_not_scheduled():
    clock = Clock(10.0)
    sim = make_sim(clock=clock)
    sim.add(make_req("a", 4, deadline=9.0))
    so = sim.step()
    assert so.scheduled == [] and [o.finish_reason for o in so.finished] == ["deadline"]
    sim.check_drained()


def test_running_request_past_its_deadline_ends_with_deadline():
    clock = Clock(0.0)
    sim = make_sim(clock=clock)
    r = sim.add(make_req("a", 6, max_tokens=100, deadline=3.0))
    other = sim.add(make_req("b", 6, max_tokens=6))
    for t in range(3):
        clock.t = float(t)
        sim.step()
    assert r.num_output_tokens == 3
    clock.t = 3.0
    so = sim.step()
    assert [(o.request_id, o.finish_reason) for o in so.finished] == [("a", FinishReason.DEADLINE)]
    assert sim.ids(so) == ["b"]
    assert sim.sched.kv.block_ids("a") == [] and r.timing.finished == 3.0
    assert sim.tokens["a"] == expected_alone(r, 1024)[0][:3]
    sim.run()
    assert sim.tokens["b"] == expected_alone(other, 1024)[0]
    sim.check_drained()


# -- stop conditions -------------------------------------------------------------------------


def scripted(outputs: dict[str, list[int]], prompt_len: int, default: int = 500) -> TokenFn:
    def fn(rid: str, pos: int) -> int:
        seq = outputs.get(rid, [])
        i = pos - prompt_len
        return seq[i] if i < len(seq) else default

    return fn


def _run_one(script: list[int], max_model_len: int = 1024, num_blocks: int = 64, **params):
    sim = make_sim(num_blocks=num_blocks, max_model_len=max_model_len)
    sim.token_fn = scripted({"r": script}, prompt_len=4)
    req = sim.add(make_req("r", [11, 12, 13, 14], **params))
    sim.run()
    sim.check_drained()
    return sim, req


def test_eos_stops():
    sim, req = _run_one([5, 6, EOS, 7], max_tokens=10)
    assert sim.tokens["r"] == [5, 6, EOS] == req.output_token_ids
    last = sim.finals["r"][-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason is None


def test_eos_is_ignored_with_ignore_eos():
    sim, _ = _run_one([5, EOS, 7], max_tokens=6, ignore_eos=True)
    assert sim.tokens["r"] == [5, EOS, 7, 500, 500, 500]
    assert sim.finish_reason("r") == FinishReason.LENGTH


def test_eos_does_not_stop_before_min_tokens():
    sim, _ = _run_one([EOS, 5, EOS, 6], max_tokens=10, min_tokens=2)
    assert sim.tokens["r"] == [EOS, 5, EOS]
    assert sim.finish_reason("r") == FinishReason.STOP


def test_eos_at_exactly_min_tokens_stops():
    sim, _ = _run_one([5, EOS, 6], max_tokens=10, min_tokens=2)
    assert sim.tokens["r"] == [5, EOS]


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    sim, _ = _run_one([5, 9, 7, 8], max_tokens=10, stop_token_ids=[7, 8])
    assert sim.tokens["r"] == [5, 9, 7]
    last = sim.finals["r"][-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == 7


def test_stop_token_ids_apply_with_ignore_eos_but_not_before_min_tokens():
    sim, _ = _run_one(
        [7, EOS, 7, 9], max_tokens=10, stop_token_ids=[7], ignore_eos=True, min_tokens=2
    )
    assert sim.tokens["r"] == [7, EOS, 7]
    assert sim.finals["r"][-1].stop_reason == 7


def test_a_stop_token_ends_the_request_flagged_as_stopped_by_token():
    # EngineCoreOutput.stopped_by_token: "the last new token is an EOS or stop token id";
    # the output processor relies on it to keep that token out of the text.
    sim, _ = _run_one([5, EOS], max_tokens=10)
    assert sim.finals["r"][-1].stopped_by_token
    sim, _ = _run_one([5, 7], max_tokens=10, stop_token_ids=[7])
    assert sim.finals["r"][-1].stopped_by_token
    sim, _ = _run_one([5, 6], max_tokens=2)
    assert not sim.finals["r"][-1].stopped_by_token


def test_max_tokens_gives_length():
    sim, req = _run_one([5, 6, 7, 8, 9], max_tokens=3)
    assert sim.tokens["r"] == [5, 6, 7] and req.num_output_tokens == 3
    last = sim.finals["r"][-1]
    assert last.finish_reason == FinishReason.LENGTH and last.stop_reason is None


def test_max_model_len_gives_length():
    sim, req = _run_one([], max_model_len=10, max_tokens=100)
    assert req.num_tokens == 10 and len(sim.tokens["r"]) == 6
    assert sim.finish_reason("r") == FinishReason.LENGTH


def test_kv_capacity_bounds_the_model_length():
    sim, req = _run_one([], num_blocks=3, max_tokens=100)  # 3 blocks * 4 = 12 tokens
    assert sim.sched.max_model_len == 12
    assert req.num_tokens == 12 and sim.finish_reason("r") == FinishReason.LENGTH


def test_prompt_of_max_model_len_tokens_is_rejected():
    sched = Scheduler(make_config(), num_blocks=64, max_model_len=8)
    with pytest.raises(ValueError, match="at most 7 tokens"):
        sched.add_request(make_req("a", 8))
    assert not sched.has_unfinished() and sched.num_waiting == 0
    sched.add_request(make_req("b", 7))  # 7 + one generated token fits


def test_prompt_bigger_than_the_whole_kv_cache_is_rejected():
    sched = Scheduler(make_config(), num_blocks=2, max_model_len=4096)
    with pytest.raises(ValueError, match="KV capacity"):
        sched.add_request(make_req("a", 100))
    with pytest.raises(ValueError):
        sched.check_fits(8)
    sched.check_fits(7)


def test_largest_prompt_the_cache_holds_completes_without_hanging():
    sim = make_sim(num_blocks=2, max_model_len=4096, max_num_batched_tokens=3)
    sim.add(make_req("big", 7, max_tokens=50))
    sim.add(make_req("small", 2, max_tokens=3))
    sim.run(max_steps=100)
    assert len(sim.tokens["big"]) == 1 and sim.finish_reason("big") == FinishReason.LENGTH
    sim.check_drained()


def test_duplicate_request_id_is_rejected():
    sched = Scheduler(make_config(), num_blocks=8, max_model_len=64)
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_req("a", 3))


# -- prefix caching --------------------------------------------------------------------------


def test_second_request_with_the_same_prompt_reuses_the_cached_blocks():
    sim = make_sim(num_blocks=16)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    a = sim.add(make_req("a", prompt, max_tokens=1))
    sim.step()
    assert a.num_cached_tokens == 0
    b = sim.add(make_req("b", prompt, max_tokens=3))
    so = sim.step()
    (x,) = so.scheduled
    assert (x.start, x.num_new_tokens) == (8, 2)
    assert b.num_cached_tokens == 8
    assert sim.sched.kv.num_free_blocks == 16 - 3  # a's two blocks + a new tail
    assert sim.sched.kv.prefix_hit_rate == pytest.approx(8 / 20)
    sim.run()
    assert sim.tokens["b"] == expected_alone(b, 1024)[0]
    sim.check_drained()


def test_prefix_hit_never_covers_the_last_prompt_token():
    sim = make_sim(num_blocks=16)
    prompt = list(range(10, 18))  # exactly 2 full blocks
    sim.add(make_req("a", prompt, max_tokens=1))
    sim.step()
    b = sim.add(make_req("b", prompt, max_tokens=1))
    (x,) = sim.step().scheduled
    assert b.num_cached_tokens == 4 and (x.start, x.num_new_tokens) == (4, 4)
    assert b.num_output_tokens == 1
    sim.check_drained()


def test_running_requests_share_prefix_blocks():
    sim = make_sim(num_blocks=16)
    prompt = list(range(10, 20))
    sim.add(make_req("a", prompt, max_tokens=6))
    sim.step()
    free = sim.sched.kv.num_free_blocks
    b = sim.add(make_req("b", prompt, max_tokens=6))
    sim.step()
    assert b.num_cached_tokens == 8
    shared = sim.sched.kv.block_ids("a")[:2]
    assert sim.sched.kv.block_ids("b")[:2] == shared
    assert all(sim.sched.kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    assert sim.sched.kv.num_free_blocks == free - 1  # only b's own tail block
    sim.run()
    sim.check_drained()


def test_prefix_hit_within_the_same_step():
    sim = make_sim(num_blocks=16)
    prompt = list(range(10, 23))
    sim.add(make_req("a", prompt, max_tokens=2))
    b = sim.add(make_req("b", prompt, max_tokens=2))
    so = sim.step()  # Sim checks b reads the K/V that a writes in this step
    assert b.num_cached_tokens == 12
    assert [(x.start, x.num_new_tokens) for x in so.scheduled] == [(0, 13), (12, 1)]
    sim.run()
    sim.check_drained()


def test_same_block_after_a_different_prefix_is_not_a_hit():
    sim = make_sim(num_blocks=16)
    x, y, z = [1, 3, 4, 5], [6, 7, 8, 9], [11, 12, 13, 14]
    sim.add(make_req("a", x + y + [20], max_tokens=1))
    sim.step()
    b = sim.add(make_req("b", z + y + [20], max_tokens=1))
    c = sim.add(make_req("c", x + z + [20], max_tokens=1))
    sim.step()
    assert b.num_cached_tokens == 0
    assert c.num_cached_tokens == 4
    sim.check_drained()


def test_prefix_caching_disabled_never_hits():
    sim = make_sim(num_blocks=16, enable_prefix_caching=False)
    prompt = list(range(10, 20))
    sim.add(make_req("a", prompt, max_tokens=1))
    sim.step()
    b = sim.add(make_req("b", prompt, max_tokens=1))
    sim.step()
    assert b.num_cached_tokens == 0 and sim.sched.kv.prefix_hit_rate == 0.0


def test_eviction_keeps_the_prefix_and_drops_the_tail_first():
    sim = make_sim(num_blocks=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks + 1
    sim.add(make_req("a", prompt, max_tokens=1))
    sim.step()
    sim.add(make_req("o", 5, max_tokens=1))  # takes 2 blocks: a's tail two
    sim.step()
    b = sim.add(make_req("b", prompt, max_tokens=1))
    sim.step()
    assert b.num_cached_tokens == 8
    sim.check_drained()


def test_preempted_request_resumes_from_its_own_cached_prefix():
    sim = make_sim(num_blocks=6)
    a = sim.add(make_req("a", 7, max_tokens=9, arrival=0.0))
    b = sim.add(make_req("b", 7, max_tokens=9, arrival=1.0))
    sim.run()
    assert b.timing.preemptions == 1 and b.num_cached_tokens == 0
    preempted_at = next(so.step for so in sim.history if so.preempted_ids == ["b"])
    resumed = next(
        x for so in sim.history[preempted_at:] for x in so.scheduled if x.request_id == "b"
    )
    # Its freed blocks kept their hashes; the prefix still cached is not recomputed.
    assert resumed.start == 8
    assert sim.tokens["a"] == expected_alone(a, sim.sched.max_model_len)[0]
    assert sim.tokens["b"] == expected_alone(b, sim.sched.max_model_len)[0]
    sim.check_drained()


def test_usage_figure():
    sim = make_sim(num_blocks=10, enable_prefix_caching=False)
    assert sim.sched.kv.usage == 0.0
    sim.add(make_req("a", 9, max_tokens=5))
    sim.step()
    assert sim.sched.kv.usage == pytest.approx(3 / 10)
    sim.run()
    assert sim.sched.kv.usage == 0.0


# -- random workloads --------------------------------------------------------------------


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    add_step: int
    abort_step: int | None
    deadline: float | None


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2 if bs == 1 else 1, 24))
    model_len = draw(st.integers(2, 80))
    cfg = make_config(
        block_size=bs,
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_num_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        scheduling=draw(st.sampled_from(["continuous", "continuous", "static"])),
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
        aging_s=draw(st.sampled_from([0.0, 2.0, 30.0])),
    )
    cap = min(model_len, num_blocks * bs)
    base = draw(st.lists(st.integers(10, 13), min_size=cap, max_size=cap))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, cap - 1))
        shared = draw(st.integers(0, n))
        prompt = base[:shared] + draw(
            st.lists(st.integers(10, 13), min_size=n - shared, max_size=n - shared)
        )
        max_tokens = draw(st.integers(1, 24))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens))),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.sampled_from([3, 4, 5]), max_size=2)),
        )
        add_step = draw(st.integers(0, 12))
        abort = draw(st.none() | st.integers(add_step, add_step + 30))
        deadline = draw(st.none() | st.integers(add_step, add_step + 40).map(float))
        specs.append(
            Spec(f"q{i}", prompt, params, draw(st.integers(0, 3)), add_step, abort, deadline)
        )
    return cfg, num_blocks, model_len, specs


def small_vocab_token(rid: str, pos: int) -> int:
    return zlib.crc32(f"{rid}:{pos}".encode()) % 12  # hits EOS (2) and stop ids often


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_terminate_without_leaks(workload):
    run_workload(*workload)


def run_workload(cfg: EngineConfig, num_blocks: int, model_len: int, specs: list[Spec]) -> int:
    """Run a workload to the end, checking every step; returns the number of steps."""
    clock = Clock(0.0)
    sim = Sim(Scheduler(cfg, num_blocks, model_len, clock=clock), token_fn=small_vocab_token)
    mml = sim.sched.max_model_len
    total_tokens = sum(len(s.prompt) + s.params.max_tokens for s in specs)
    # Without preemption every step computes at least one token; recomputation after
    # preemption costs more, but a livelock costs forever.
    bound = 3 * (total_tokens + max(s.add_step for s in specs)) + 20
    pending = sorted(specs, key=lambda s: s.add_step)
    step = 0
    while pending or sim.sched.has_unfinished():
        clock.t = float(step)
        while pending and pending[0].add_step <= step:
            s = pending.pop(0)
            sim.add(
                Request(
                    s.rid,
                    s.prompt,
                    s.params,
                    arrival_time=clock.t,
                    priority=s.priority,
                    deadline=s.deadline,
                    eos_token_ids=(EOS,),
                )
            )
        for s in specs:
            if s.abort_step == step and s.rid in sim.reqs:
                sim.abort(s.rid)
        sim.step()
        step += 1
        assert step <= bound, f"no end after {step} steps"

    sim.check_drained()
    if cfg.scheduling == "static":
        assert sim.sched.num_preemptions == 0
    for s in specs:
        req = sim.reqs[s.rid]
        outs = sim.finals[s.rid]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        want, want_reason = expected_alone(req, mml, small_vocab_token)
        got, reason = sim.tokens[s.rid], outs[-1].finish_reason
        assert got == req.output_token_ids
        if reason in (FinishReason.ABORT, FinishReason.DEADLINE):
            assert got == want[: len(got)]
        else:
            assert (got, reason) == (want, want_reason)
    return step
