"""Fair share between clients (the Virtual Token Counter policy) and the prefill/decode
mix, driven through the scheduler with the fake model of test_scheduler."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.unit.test_scheduler import Sim, make_config, make_req
from worker.engine.fairness import DECODE_WEIGHT, PREFILL_WEIGHT, FairPolicy
from worker.engine.scheduler import Scheduler
from worker.request import Request


def fair_sim(weights: dict[str, float], **kw: object) -> Sim:
    cfg = make_config(
        policy="fair",
        client_weights=tuple(weights.items()),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        **kw,
    )
    return Sim(Scheduler(cfg, num_blocks=4096, max_model_len=4096))


def client_req(client: str, i: int, *, prompt: int = 6, max_tokens: int = 6) -> Request:
    req = make_req(f"{client}-{i}", prompt, max_tokens=max_tokens, ignore_eos=True)
    req.client = client
    req.seq = i  # the scheduler numbers requests; the policy tests stand in for it
    return req


def service_per_step(sim: Sim) -> list[Counter[str]]:
    """Per step, each client's service: prefill tokens weigh 1, decode tokens 2."""
    out = []
    for so in sim.history:
        c: Counter[str] = Counter()
        for x in so.scheduled:
            weight = DECODE_WEIGHT if x.is_decode else PREFILL_WEIGHT
            c[sim.reqs[x.request_id].client] += weight * x.num_new_tokens
        out.append(c)
    return out


@pytest.mark.parametrize(("wa", "wb"), [(1.0, 1.0), (1.0, 3.0)])
def test_backlogged_clients_share_service_by_weight_in_every_window(wa: float, wb: float) -> None:
    sim = fair_sim({"a": wa, "b": wb})
    for i in range(300):  # a's backlog first: FIFO would serve all of it before b
        sim.add(client_req("a", i))
    for i in range(300):
        sim.add(client_req("b", i))
    waiting = {"a": 300, "b": 300}
    steps_both_waiting = 0
    while waiting["a"] and waiting["b"]:
        so = sim.step()
        for rid in sim.ids(so):
            if sim.admitted_at[rid] == so.step:
                waiting[sim.reqs[rid].client] -= 1
        steps_both_waiting += 1
    windows = service_per_step(sim)[:steps_both_waiting]
    expected = wa / (wa + wb)
    shares = []
    for start in range(0, len(windows) - 49, 50):
        total: Counter[str] = sum(windows[start : start + 50], Counter())
        shares.append(total["a"] / (total["a"] + total["b"]))
    assert len(shares) >= 4, "too few windows to judge"
    assert all(abs(s - expected) <= 0.05 for s in shares), (expected, shares)


def test_a_newcomer_is_admitted_within_a_batch_of_the_backlog() -> None:
    """b's first request waits for at most max_num_seqs further admissions of a's."""
    sim = fair_sim({"a": 1.0, "b": 1.0})
    for i in range(200):
        sim.add(client_req("a", i, max_tokens=20))
    for _ in range(60):
        sim.step()
    before = len(sim.admitted_at)
    sim.add(client_req("b", 0, max_tokens=20))
    while "b-0" not in sim.admitted_at:
        sim.step()
    a_admitted_meanwhile = len(sim.admitted_at) - before - 1
    assert a_admitted_meanwhile <= sim.cfg.max_num_seqs


def test_a_client_alone_gets_every_slot_and_weights_of_unlisted_clients_are_one() -> None:
    sim = fair_sim({"a": 3.0})
    for i in range(40):
        sim.add(client_req("z", i))  # not listed: weight 1
    sim.step()
    assert sim.sched.num_running == sim.cfg.max_num_seqs  # work-conserving
    assert isinstance(sim.sched.policy, FairPolicy) and sim.sched.policy.weight("z") == 1.0


def test_idle_time_is_not_banked() -> None:
    """A client that had nothing waiting starts from the lowest waiting counter, not 0:
    coming back after a long pause does not buy it the whole engine."""
    policy = FairPolicy({"a": 1.0, "b": 1.0})
    a = client_req("a", 0)
    policy.add(a)
    policy.served(policy.pop(), 0, 500)  # a received 6 + 1,000 units of service
    policy.add(client_req("a", 1))
    policy.add(client_req("b", 0))  # b was idle all along
    assert policy.counters["b"] == policy.counters["a"] == 1006.0


def test_running_cap_per_client_leaves_slots_to_others() -> None:
    sim = fair_sim({"a": 1.0, "b": 1.0}, client_max_running=2)
    for i in range(20):
        sim.add(client_req("a", i))
    sim.step()
    assert sim.sched.num_running == 2  # the cap, though slots are free
    sim.add(client_req("b", 0))
    sim.step()
    clients = Counter(r.client for r in sim.sched.running)
    assert clients["a"] == 2 and clients["b"] == 1


def test_preemption_takes_from_the_client_served_most() -> None:
    policy = FairPolicy({"a": 1.0, "b": 1.0})
    reqs = [client_req("a", 0), client_req("b", 0), client_req("a", 1)]
    for r in reqs:
        policy.add(r)
    running = [policy.pop() for _ in reqs]
    policy.served(running[0], 0, 10)  # a is ahead (prompts of 6 each were charged)
    victim = policy.victim(running)
    assert victim.client == "a" and victim.request_id == "a-1"  # a's newest


# -- the prefill / decode mix ----------------------------------------------------------------


def mix_sim(mix: str) -> Sim:
    cfg = make_config(max_num_seqs=8, max_num_batched_tokens=64, prefill_mix=mix, prefill_budget=16)
    return Sim(Scheduler(cfg, num_blocks=4096, max_model_len=4096))


def run_mix(mix: str) -> Sim:
    sim = mix_sim(mix)
    for i in range(4):  # running decodes
        sim.add(make_req(f"d{i}", 8, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        sim.step()
    for i in range(4):  # then long prompts arrive
        sim.add(make_req(f"p{i}", 60, max_tokens=4, ignore_eos=True))
    sim.run()
    return sim


def decode_steps(sim: Sim, rid: str) -> list[int]:
    return [so.step for so in sim.history if rid in sim.ids(so)]


def test_chunked_caps_prompt_tokens_per_step_and_decodes_never_stall() -> None:
    sim = run_mix("chunked")
    for so in sim.history:
        assert sum(x.num_new_tokens for x in so.scheduled if not x.is_decode) <= 16
    for i in range(4):  # every step from its first to its last: no gap
        steps = decode_steps(sim, f"d{i}")
        assert steps == list(range(steps[0], steps[0] + len(steps)))
    assert all(len(sim.tokens[f"p{i}"]) == 4 for i in range(4))


def test_prefill_first_lets_decodes_sit_out_steps_that_admit() -> None:
    first, default = run_mix("prefill-first"), run_mix("decode-first")

    def ttft_steps(sim: Sim) -> list[int]:
        return [sim.admitted_at[f"p{i}"] for i in range(4)]

    assert max(ttft_steps(first)) <= max(ttft_steps(default))
    gaps = [
        b - a
        for i in range(4)
        for a, b in zip(
            decode_steps(first, f"d{i}"), decode_steps(first, f"d{i}")[1:], strict=False
        )
    ]
    assert max(gaps) > 1, "prefill-first never paused the decodes for new prompts"
    # every request still gets exactly its tokens
    for sim in (first, default):
        assert all(len(sim.tokens[f"d{i}"]) == 40 for i in range(4))
