"""The engine on a tiny random model: batching must never change what a request gets."""

from __future__ import annotations

import time

import pytest
import torch

from tests.procfs import vm_flags
from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.hardware import HUGE_PAGE, THP_SETTING, detect_cores
from worker.model.loader import load_model
from worker.request import FinishReason, SamplingParams

VOCAB = 49152


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path = tiny_model_dir("smollm2")
    return load_model(str(path))


def make_engine(tiny, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(model=str(tiny.path), **cfg), loaded=tiny)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]


def params(n: int, seed: int = 0) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(seed + 1)
    return [
        SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
        for m in torch.randint(1, 24, (n,), generator=g).tolist()
    ]


def one_at_a_time(tiny, ps, sps) -> list[list[int]]:
    eng = make_engine(tiny)
    return [eng.generate([p], sp)[0].token_ids for p, sp in zip(ps, sps, strict=True)]


def test_concurrent_equals_sequential(tiny) -> None:
    ps, sps = prompts(12), params(12)
    alone = one_at_a_time(tiny, ps, sps)
    eng = make_engine(tiny)
    together = [o.token_ids for o in eng.generate(ps, sps)]
    assert together == alone
    assert [len(t) for t in together] == [sp.max_tokens for sp in sps]
    assert max(s.batch_size for s in eng.recent_stats) > 1  # they really shared steps


def test_identical_under_preemption(tiny) -> None:
    ps, sps = prompts(10, seed=3), params(10, seed=3)
    alone = one_at_a_time(tiny, ps, sps)
    # 24 blocks of 4 tokens: far too few for ten growing sequences at once.
    eng = make_engine(tiny, num_kv_blocks=24)
    outs = eng.generate(ps, sps)
    assert [o.token_ids for o in outs] == alone
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.timing.preemptions for o in outs) == eng.scheduler.num_preemptions
    assert eng.scheduler.kv.num_free_blocks == 24  # nothing leaked


def test_identical_under_chunked_prefill(tiny) -> None:
    ps, sps = prompts(6, seed=5, lo=30, hi=60), params(6, seed=5)
    alone = one_at_a_time(tiny, ps, sps)
    eng = make_engine(tiny, max_num_batched_tokens=16)
    outs = eng.generate(ps, sps)
    assert [o.token_ids for o in outs] == alone
    stats = list(eng.recent_stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in stats)
    # prefills were split and shared steps with decodes
    assert any(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in stats)


def test_prefix_cache_reuse_same_output(tiny) -> None:
    shared = prompts(1, seed=9, lo=40, hi=41)[0]
    ps = [shared + [100 + i] for i in range(4)]
    sps = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    alone = one_at_a_time(tiny, ps, sps)
    eng = make_engine(tiny)
    first = eng.generate(ps[:1], sps[0])[0]
    rest = eng.generate(ps[1:], sps[0])
    assert [first.token_ids] + [o.token_ids for o in rest] == alone
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in rest)  # 10 full blocks of the shared 41
    assert eng.scheduler.kv.prefix_hit_rate > 0.5


def test_seeded_sampling_independent_of_batch(tiny) -> None:
    p = prompts(1, seed=11)[0]
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = make_engine(tiny).generate([p], sp)[0].token_ids
    others = prompts(5, seed=12)
    other_sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = make_engine(tiny).generate(
        others[:2] + [p] + others[2:], [other_sp] * 2 + [sp] + [other_sp] * 3
    )
    assert outs[2].token_ids == alone
    different_seed = make_engine(tiny).generate(
        [p], SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert different_seed[0].token_ids != alone


def test_stream_deltas_and_stop_string(tiny) -> None:
    eng = make_engine(tiny)
    p = prompts(1, seed=13)[0]
    full = eng.generate([p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]  # a stop string from the middle of the greedy text
    eng.add_request(
        "s", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,))
    )
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.delta_text)
            if out.finished:
                final = out
    assert final is not None
    assert final.finish_reason == FinishReason.STOP and final.stop_reason == stop
    assert final.text == full.text[: full.text.find(stop)]
    assert "".join(deltas) == final.text
    assert eng.scheduler.kv.num_free_blocks == 256


def test_abort_and_deadline(tiny) -> None:
    eng = make_engine(tiny)
    ps = prompts(3, seed=17)
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    eng.add_request("run", ps[0], sp)
    eng.step()
    eng.step()
    eng.add_request("late", ps[1], sp, deadline=time.time() - 1)  # already past
    eng.add_request("soon", ps[2], sp, deadline=time.time() + 0.3)
    outs = {o.request_id: o for o in eng.step() if o.finished}
    assert outs["late"].finish_reason == FinishReason.DEADLINE
    assert outs["late"].token_ids == []
    aborted = eng.abort(["run"])
    assert aborted[0].finish_reason == FinishReason.ABORT and aborted[0].finished
    time.sleep(0.35)
    outs = {o.request_id: o for o in eng.step() if o.finished}
    assert outs["soon"].finish_reason == FinishReason.DEADLINE
    assert not eng.has_unfinished()
    assert eng.scheduler.kv.num_free_blocks == 256


def test_rejects_what_cannot_fit(tiny) -> None:
    eng = make_engine(tiny, num_kv_blocks=8)  # 32 tokens in all
    with pytest.raises(ValueError, match="at most 31 tokens"):
        eng.add_request("big", list(range(3, 40)), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("bad", [VOCAB + 5], SamplingParams())
    # A request that fits but would outgrow the cache ends with 'length', never hangs.
    out = eng.generate(
        [list(range(3, 20))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    )[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert out.num_prompt_tokens + len(out.token_ids) == 32


def test_static_mode_same_tokens_more_steps(tiny) -> None:
    ps, sps = prompts(8, seed=21), params(8, seed=21)
    cont = make_engine(tiny, max_num_seqs=4)
    stat = make_engine(tiny, max_num_seqs=4, scheduling="static")
    a = [o.token_ids for o in cont.generate(ps, sps)]
    b = [o.token_ids for o in stat.generate(ps, sps)]
    assert a == b
    # Request-level batching waits for the longest member: more steps for the same work.
    assert len(stat.recent_stats) > len(cont.recent_stats)


def test_small_cpu_steps_run_on_one_thread(tiny) -> None:
    """A step of one or two tokens of a small model runs on one OpenMP thread, larger
    ones on all."""
    before = torch.get_num_threads()
    try:
        eng = make_engine(tiny, num_threads=2)
        eng.add_request("one", [5], SamplingParams(max_tokens=1))
        eng.step()
        assert torch.get_num_threads() == 1
        eng.add_request("many", list(range(3, 40)), SamplingParams(max_tokens=1))
        eng.step()
        assert torch.get_num_threads() == 2
        # an engine built after a small step left one thread uses the cores available
        eng.add_request("two", [5], SamplingParams(max_tokens=1))
        eng.step()
        assert torch.get_num_threads() == 1
        again = make_engine(tiny)
        again.add_request("many", list(range(3, 40)), SamplingParams(max_tokens=1))
        again.step()
        assert torch.get_num_threads() == detect_cores()
    finally:
        torch.set_num_threads(before)


def test_hold_hook_stops_a_marked_request_until_the_gate_opens(tiny, tmp_path, monkeypatch) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("KVFLOW_TEST_HOOKS", f'{{"hold_token": 7, "gate": "{gate}"}}')
    eng = make_engine(tiny)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("held", [5, 7, 9], greedy)
    eng.add_request("free", [5, 8, 9], greedy)
    done: dict[str, list[int]] = {}
    for _ in range(30):  # however many steps: the held request stays at its first token
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert set(done) == {"free"} and len(done["free"]) == 4
    held = eng.scheduler.requests["held"]
    assert held.num_output_tokens == 1 and held in eng.scheduler.running
    gate.unlink()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    alone = make_engine(tiny).generate([[5, 7, 9]], greedy)[0].token_ids
    assert done["held"] == alone


def test_hold_hook_lets_an_abort_through(tiny, tmp_path, monkeypatch) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("KVFLOW_TEST_HOOKS", f'{{"hold_token": 7, "gate": "{gate}"}}')
    eng = make_engine(tiny)
    eng.add_request("held", [5, 7, 9], SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()
    eng.step()
    (out,) = eng.abort(["held"])
    assert out.finished and out.finish_reason == FinishReason.ABORT
    assert not eng.has_unfinished()


def test_a_tuned_engine_runs_at_its_measured_cap_and_answers_the_same(tiny) -> None:
    """--tune-batch probes decode steps before any request; the probe leaves nothing
    behind (same greedy outputs as an untuned engine) and the scheduler keeps the cap."""
    ps, sps = prompts(12, seed=5), params(12, seed=5)
    plain = [o.token_ids for o in make_engine(tiny).generate(ps, sps)]
    eng = make_engine(tiny, tune_batch=True)
    point = eng.operating_point
    assert point is not None
    assert [b for b, _ in point.curve] == [4, 8, 16]
    assert all(rate > 0 for _, rate in point.curve)
    assert point.max_running in (4, 8, 16)
    assert eng.scheduler.max_running == point.max_running
    assert [o.token_ids for o in eng.generate(ps, sps)] == plain
    assert max(s.batch_size for s in eng.recent_stats) <= point.max_running


def test_the_scheduler_never_runs_more_than_its_cap(tiny) -> None:
    eng = make_engine(tiny)
    eng.scheduler.max_running = 3
    ps, sps = prompts(10, seed=6), params(10, seed=6)
    assert [o.token_ids for o in eng.generate(ps, sps)] == one_at_a_time(tiny, ps, sps)
    assert max(s.batch_size for s in eng.recent_stats) == 3


def test_the_kv_cache_asks_for_huge_pages_and_starts_zeroed(tiny) -> None:
    """Each layer's K and V cache is advised for 2 MB pages before it is first touched
    (worker.hardware.advise_huge_pages) and is all zeros (padded attention reads it)."""
    # Only where this machine's kernel allows it (madvise or always; not never).
    allowed = THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()
    engine = make_engine(tiny, block_size=16, num_kv_blocks=8192)
    for k, v in engine.runner.kv_caches:
        for t in (k, v):
            assert t.numel() * t.element_size() >= 4 * HUGE_PAGE
            assert ("hg" in vm_flags(t.data_ptr() + 2 * HUGE_PAGE)) == allowed
            assert not t.any()


def test_small_steps_of_a_large_model_keep_every_thread(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SMALL_MODEL_BYTES of weights a step streams them, and two threads read faster
    than one: its one-token steps keep the threads (here the limit is lowered under the
    tiny model's size rather than a large model loaded)."""
    import worker.engine.model_runner as runner_mod

    monkeypatch.setattr(runner_mod, "SMALL_MODEL_BYTES", 0)
    before = torch.get_num_threads()
    try:
        eng = make_engine(tiny, num_threads=2)
        eng.add_request("one", [5], SamplingParams(max_tokens=1))
        eng.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_greedy_steps_pick_without_the_logits_as_with_them(tiny_model_dir, monkeypatch) -> None:
    """A bfloat16 model with a narrow output projection: steps whose rows all pick
    greedily take their tokens from the model's candidates (greedy_tokens), and give
    the tokens the logits and the sampler give; a step with a sampled row beside them
    takes the logits."""
    loaded = load_model(str(tiny_model_dir("smollm2")), dtype="bfloat16")
    loaded.model.narrow_output_projection(torch.bfloat16)  # as the loader does for 576+
    ps, sps = prompts(10, seed=3), params(10, seed=3)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    real = loaded.model.greedy_tokens
    outs: list[list[list[int]]] = []
    calls = {True: 0, False: 0}
    for shortcut in (True, False):
        # the C kernels' attention and layer ops on any CPU, which the pick rides on
        eng = make_engine(loaded, dtype="bfloat16", attention="native")
        eng.runner.greedy_shortcut = shortcut
        assert eng.runner.model.picks_greedily(eng.runner.step_ops)

        def counted(*a, on=shortcut, **kw):
            calls[on] += 1
            return real(*a, **kw)

        monkeypatch.setattr(eng.runner.model, "greedy_tokens", counted)
        outs.append([o.token_ids for o in eng.generate(ps + [ps[0]], sps + [sampled])])
    assert outs[0] == outs[1]
    assert calls[True] > 0, "the greedy steps took the logits"
    assert calls[False] == 0  # switched off, never asked
