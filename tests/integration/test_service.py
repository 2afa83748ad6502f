"""`kvflow worker` end to end: real RabbitMQ, real PostgreSQL, workers as subprocesses
(the harness: tests/integration/harness.py).

Most tests run the tiny random-weight model (its text is random tokens); the round
trip, continuous batching and drain tests run the real default model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import pytest

from broker.client import Handle, RequestFailed
from broker.messages import ENQUEUED_AT_HEADER
from broker.topology import Topology
from tests.integration.harness import (
    HOLD,
    LOOKAHEAD,
    Harness,
    HeldSampler,
    UnackedSampler,
    results,
    seconds,
    spawn,
    worker_command,
)
from tests.integration.helpers import eventually, stored
from worker.admin.queues import queue_counts
from worker.ledger.store import LedgerStore, RequestRecord

pytestmark = pytest.mark.integration


# -- 1. round trip --

N_ROUND_TRIP = 200


@pytest.mark.timeout(180)
async def test_round_trip_through_two_workers(harness: Harness, default_model_dir: Path) -> None:
    h = harness
    a = h.start("rt-a", model=None, max_num_seqs=16)
    b = h.start("rt-b", model=None, max_num_seqs=16)
    await h.ready(a, b)

    handles: list[Handle] = []
    window: dict[str, tuple[float, float]] = {}  # id -> (before submit, after submit)
    streamed = {f"rt-{i}" for i in range(N_ROUND_TRIP) if i % 4 == 0}
    for i in range(N_ROUND_TRIP):
        kind = ("prompt", "messages", "prompt_token_ids")[i % 3]
        form: dict[str, Any] = {
            "prompt": {"prompt": f"Name a colour, number {i}:"},
            "messages": {"messages": [{"role": "user", "content": f"Say {i}."}]},
            "prompt_token_ids": {"prompt_token_ids": [1, 100 + i, 200 + i, 300 + i]},
        }[kind]
        before = time.time()
        handle = await h.client.submit(
            **form, id=f"rt-{i}", max_tokens=4, stream=f"rt-{i}" in streamed, metadata={"i": i}
        )
        window[handle.id] = (before, time.time())
        handles.append(handle)

    async def outcome(handle: Handle) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if handle.id in streamed:
            deltas = [d async for d in handle.stream(timeout=150)]
            assert handle.final is not None
            return deltas, handle.final
        return [], await handle.result(150)

    outcomes = await asyncio.gather(*(outcome(x) for x in handles))
    rows = await h.settled([x.id for x in handles])

    served: dict[str, int] = defaultdict(int)
    for i, (handle, (deltas, result)) in enumerate(zip(handles, outcomes, strict=True)):
        rid = handle.id
        assert result["type"] == "result" and result["id"] == rid
        assert result["metadata"] == {"i": i}
        assert result["usage"]["completion_tokens"] == len(result["token_ids"]) >= 1
        raw = h.client.replies[rid]
        # exactly one result, last; deltas only before it, numbered from 0
        assert h.client.kinds(rid).count("result") == 1, h.client.kinds(rid)
        assert raw[-1]["type"] == "result", h.client.kinds(rid)
        raw_deltas = [r for r in raw if r["type"] == "delta"]
        if rid in streamed:
            assert deltas == raw_deltas and deltas, f"{rid}: no deltas streamed"
            assert [d["index"] for d in deltas] == list(range(len(deltas)))
            assert "".join(d["text"] for d in deltas) == result["text"]
            assert [t for d in deltas for t in d["token_ids"]] == result["token_ids"]
        else:
            assert raw_deltas == [], f"{rid} did not ask to stream"

        row = rows[rid]
        assert row["status"] == "completed", row
        assert row["output_text"] == stored(result["text"])
        assert row["worker_id"] == result["worker"] in (a.id, b.id)
        served[row["worker_id"]] += 1
        for name in ("enqueued_at", "received_at", "admitted_at", "first_token_at", "finished_at"):
            assert row[name] is not None, f"{rid}: {name} missing"
        for name in ("queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "prompt_tokens"):
            assert row[name] is not None, f"{rid}: {name} missing"
        assert row["enqueued_at"] <= row["admitted_at"] <= row["first_token_at"]
        assert row["first_token_at"] <= row["finished_at"]
        # queue_s counts from the producer's enqueue timestamp, not from receipt
        before, after = window[rid]
        enqueued = row["enqueued_at"].timestamp()
        assert before - 1e-3 <= enqueued <= after + 1e-3, (before, enqueued, after)
        assert result["timing"]["enqueued_at"] == pytest.approx(enqueued, abs=1e-5)
        assert row["queue_s"] >= 0
        assert row["queue_s"] == pytest.approx(
            seconds(row["enqueued_at"], row["admitted_at"]), abs=2e-3
        )
        assert result["timing"]["queue_s"] == pytest.approx(row["queue_s"], abs=1e-6)

    assert await h.count_rows() == N_ROUND_TRIP
    assert set(served) == {a.id, b.id}, f"both workers should serve: {dict(served)}"
    assert min(served.values()) >= N_ROUND_TRIP // 10, dict(served)
    assert a.alive() and b.alive()


# -- 2. continuous batching through the queue --


@pytest.mark.timeout(150)
async def test_short_requests_join_the_running_batch(
    harness: Harness, default_model_dir: Path
) -> None:
    h = harness
    max_seqs = 4
    w = h.start("cb", model=None, max_num_seqs=max_seqs)
    await h.ready(w)

    h.hold()  # the long requests stay in the batch until the short ones are done
    async with HeldSampler(h) as held, UnackedSampler(h) as broker:
        long = [
            await h.client.submit(
                prompt_token_ids=[HOLD, 5, 6, 7 + i],
                id=f"long-{i}",
                max_tokens=120,
                ignore_eos=True,
                stream=True,
            )
            for i in range(3)
        ]

        async def long_running() -> bool:  # each has its first token, and is held there
            return all("delta" in h.client.kinds(x.id) for x in long)

        await eventually(long_running, "the long requests to run", timeout=30)
        short = [await h.client.submit(f"Hi {i}", id=f"short-{i}", max_tokens=4) for i in range(6)]
        await results(short, timeout=120)
        assert not any(x.done for x in long), "precondition: the long requests are still held"
        h.release()
        await results(long, timeout=120)
        rows = await h.settled([x.id for x in (*long, *short)])

    long_rows = [rows[x.id] for x in long]
    short_rows = [rows[x.id] for x in short]
    assert all(r["status"] == "completed" for r in rows.values())
    assert all(r["completion_tokens"] == 120 for r in long_rows)
    first_long_done = min(r["finished_at"] for r in long_rows)
    first_short_enqueued = min(r["enqueued_at"] for r in short_rows)
    for r in long_rows:  # they really were running when the short ones came
        assert r["first_token_at"] < first_short_enqueued
    for r in short_rows:
        assert r["admitted_at"] < first_long_done, (r["id"], r["admitted_at"], first_long_done)
        assert r["finished_at"] < first_long_done, (r["id"], r["finished_at"], first_long_done)

    cap = max_seqs + LOOKAHEAD
    seen = (
        f"most running rows {held.max_running[w.id]}, heartbeat held {held.max_held[w.id]}, "
        f"rabbitmqctl unacked {broker.unacked}, cap {cap}"
    )
    assert held.max_running[w.id] >= max_seqs, f"the sampler never saw the worker busy: {seen}"
    assert held.max_running[w.id] <= cap, seen
    assert held.max_held[w.id] <= cap, seen
    assert broker.unacked and max(broker.unacked) <= cap, seen


# -- 3. flow control across two workers --


@pytest.mark.timeout(150)
async def test_burst_is_shared_and_pulled_by_capacity(harness: Harness, tiny_dir: Path) -> None:
    h = harness
    max_seqs, n, free = 4, 40, 16
    a = h.start("fc-a", model=tiny_dir, max_num_seqs=max_seqs)
    b = h.start("fc-b", model=tiny_dir, max_num_seqs=max_seqs)
    await h.ready(a, b)
    cap = max_seqs + LOOKAHEAD

    # The first `free` requests run through; the rest hold HOLD and sit still at their
    # first token while the gate is closed. Once the free ones are done the workers are
    # full of held requests and stop pulling: the queue then keeps what their capacity
    # left in it, for as long as the test looks, however fast the workers run.
    h.hold()
    async with HeldSampler(h) as held, UnackedSampler(h) as broker:
        handles = [
            await h.client.submit(
                prompt_token_ids=[*([HOLD] if i >= free else []), 1, 2, 3, 4 + i],
                id=f"fc-{i}",
                max_tokens=200,
                ignore_eos=True,
            )
            for i in range(n)
        ]
        await results(handles[:free], timeout=120)
        gated = n - free

        async def full() -> tuple[int] | None:
            # each worker runs max_seqs held requests at least
            count = await h.ready_count()
            return (count,) if count <= gated - 2 * max_seqs else None

        (ready,) = await eventually(full, "both workers full of held requests")
        # drained part way, and only what two workers' capacity could take
        assert gated - 2 * cap <= ready, f"{ready} ready of {gated} held: pulled past capacity"
        h.release()
        await results(handles, timeout=120)
        rows = await h.settled([x.id for x in handles])

        async def sampled() -> bool:
            return len(broker.unacked) >= 3

        await eventually(sampled, "three rabbitmqctl samples")

    seen = (
        f"most running rows {dict(held.max_running)}, heartbeat held {dict(held.max_held)}, "
        f"rabbitmqctl unacked {broker.unacked}, cap {cap} per worker"
    )
    for w in (a, b):
        assert held.max_running[w.id] >= max_seqs, f"never saw {w.id} busy: {seen}"
        assert held.max_running[w.id] <= cap, seen
        assert held.max_held[w.id] <= cap, seen
    assert max(broker.unacked) <= 2 * cap, seen

    served = defaultdict(int)
    for r in rows.values():
        assert r["status"] == "completed"
        served[r["worker_id"]] += 1
    assert served[a.id] >= n // 4 and served[b.id] >= n // 4, dict(served)
    assert await h.ready_count() == 0


# -- 4. kill -9 --


@pytest.mark.timeout(120)
async def test_killed_worker_requests_complete_exactly_once(
    harness: Harness, tiny_dir: Path
) -> None:
    h = harness
    a = h.start("kill-a", model=tiny_dir, max_num_seqs=4)
    b = h.start("kill-b", model=tiny_dir, max_num_seqs=4)
    await h.ready(a, b)

    h.hold()  # nothing finishes before A is killed
    handles = await h.submit_long("kill", 16, max_tokens=230, held=True)

    async def a_running() -> list[str]:
        rows = await h.rows()
        return [
            rid for rid, r in rows.items() if r["status"] == "running" and r["worker_id"] == a.id
        ]

    in_flight = await eventually(a_running, "requests running on worker A", timeout=30, every=0.02)
    a.proc.send_signal(signal.SIGKILL)
    assert await a.wait(10) == -signal.SIGKILL
    h.release()

    outcomes = await results(handles, timeout=90)
    rows = await h.settled([x.id for x in handles])
    assert await h.count_rows() == len(handles)
    for handle, result in zip(handles, outcomes, strict=True):
        row = rows[handle.id]
        assert row["status"] == "completed", row
        assert row["completion_tokens"] == 230
        texts = {stored(r["text"]) for r in h.client.replies[handle.id] if r["type"] == "result"}
        assert texts == {row["output_text"]}, f"{handle.id}: results disagree: {texts}"
        assert stored(result["text"]) == row["output_text"]
    rerun = [rid for rid in in_flight if rows[rid]["worker_id"] == b.id]
    assert rerun, f"none of A's in-flight requests {in_flight} was finished by B"
    assert all(rows[rid]["attempts"] >= 2 for rid in rerun)
    assert await h.dead_letter_count() == 0
    assert b.alive()


@pytest.mark.timeout(150)
async def test_engine_process_death_requeues_and_the_worker_exits(
    harness: Harness, tiny_dir: Path
) -> None:
    """The engine process dies (OOM kill, driver crash): its requests are not failed but
    given back to the queue and served by the other worker; the broken worker exits 1."""
    h = harness
    a = h.start("crash-a", model=tiny_dir, max_num_seqs=4)
    await h.ready(a)
    h.hold()  # nothing finishes before the engine is killed
    handles = await h.submit_long("crash", 8, max_tokens=230, held=True)

    async def a_running() -> list[str]:
        rows = await h.rows()
        return [rid for rid, r in rows.items() if r["status"] == "running"]

    await eventually(a_running, "requests running on worker A", timeout=30, every=0.02)
    children = Path(f"/proc/{a.proc.pid}/task/{a.proc.pid}/children").read_text().split()
    assert children, "the worker has no engine process"
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    assert await a.wait(60) == 1, a.tail()
    assert "engine failed" in a.output()

    h.release()
    b = h.start("crash-b", model=tiny_dir, max_num_seqs=4)
    await h.ready(b)
    outcomes = await results(handles, timeout=90)
    rows = await h.settled([x.id for x in handles])
    for handle, result in zip(handles, outcomes, strict=True):
        row = rows[handle.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 230, row
        assert stored(result["text"]) == row["output_text"]
        assert h.client.kinds(handle.id).count("result") == 1, h.client.kinds(handle.id)
        assert "error" not in h.client.kinds(handle.id)
    assert any(rows[x.id]["worker_id"] == b.id for x in handles)
    assert await h.dead_letter_count() == 0


@pytest.mark.timeout(90)
async def test_same_id_published_twice_at_once_is_served_once(
    harness: Harness, tiny_dir: Path
) -> None:
    """A producer's retry arriving while the first copy is still being recorded: one
    run, one row, both copies acked, nothing rejected or dead-lettered."""
    h = harness
    w = h.start("twice", model=tiny_dir, max_num_seqs=8)
    await h.ready(w)
    ids = [f"dup-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "seed": 1}
    for rid in ids:
        for _ in range(2):
            await h.publish_raw(msgpack.packb({"id": rid, **body}), rid)

    async def answered() -> bool:
        return all(h.client.kinds(rid).count("result") >= 1 for rid in ids)

    await eventually(answered, "a result for every id", timeout=60)
    rows = await h.settled(ids)
    for rid in ids:
        assert rows[rid]["status"] == "completed", rows[rid]
        assert "error" not in h.client.kinds(rid), h.client.replies[rid]
        texts = {r["text"] for r in h.client.replies[rid] if r["type"] == "result"}
        assert len(texts) == 1, texts

    async def settled_queue() -> bool:
        _, unacked = await queue_counts(h.amqp_url, h.topo.queue)
        return unacked == 0 and await h.ready_count() == 0

    await eventually(settled_queue, "every copy to be acked", timeout=20)
    assert await h.count_rows() == len(ids)
    assert await h.dead_letter_count() == 0


# -- 5. redelivery of a completed id --


@pytest.mark.timeout(90)
async def test_redelivered_completed_id_is_answered_from_the_ledger(
    harness: Harness, tiny_dir: Path
) -> None:
    h = harness
    w = h.start("redo", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)

    rid = "redo-" + uuid.uuid4().hex[:8]
    # temperature 1 on random weights: a second run would almost surely differ
    first = await (await h.client.submit("Once upon a time", id=rid, max_tokens=24)).result(30)
    row1 = (await h.settled([rid]))[rid]

    second = await (await h.client.submit("Once upon a time", id=rid, max_tokens=24)).result(30)

    async def answered_twice() -> bool:
        return h.client.kinds(rid).count("result") == 2

    await eventually(answered_twice, "the second result")
    row2 = (await h.rows([rid]))[rid]
    assert second["text"] == first["text"] and second["token_ids"] == first["token_ids"]
    assert second["worker"] == first["worker"]
    assert second["timing"]["finished_at"] == pytest.approx(
        first["timing"]["finished_at"], abs=1e-5
    ), "the model ran again"
    assert row2["attempts"] == row1["attempts"] == 1
    assert row2["finished_at"] == row1["finished_at"]
    assert row2["output_token_ids"] == first["token_ids"]
    assert await h.count_rows() == 1
    assert await h.dead_letter_count() == 0


@pytest.mark.timeout(120)
async def test_outcome_recorded_first_by_another_delivery_is_the_reply(
    harness: Harness, default_model_dir: Path
) -> None:
    """Two deliveries of one request ran (a redelivery after a lost connection): the
    one whose final row commits first is the request's outcome, and the other worker
    replies with it rather than with its own text."""
    h = harness
    w = h.start("second", model=None, max_num_seqs=4)
    await h.ready(w)

    rid = "twice-" + uuid.uuid4().hex[:8]
    h.hold()  # the worker's own run cannot end before the other outcome is recorded
    handle = await h.client.submit(
        prompt_token_ids=[HOLD, 1, 2, 3], id=rid, max_tokens=40, ignore_eos=True, stream=True
    )

    async def generating() -> bool:
        return "delta" in h.client.kinds(rid)

    await eventually(generating, "the first delta", timeout=60)
    other = RequestRecord(
        rid,
        "completed",
        output_text="the other delivery's answer",
        output_token_ids=[11, 12, 13],
        prompt_tokens=5,
        completion_tokens=3,
        finish_reason="length",
        worker_id="other-worker",
        finished_at=datetime.now(UTC),
    )
    async with await LedgerStore.open(h.db_url, flush_interval_s=0) as store:
        assert await store.record(other) is not None
    assert not handle.done, "precondition: the worker's own run is still going"
    h.release()

    result = await handle.result(90)
    assert result["text"] == other.output_text and result["token_ids"] == other.output_token_ids
    assert result["worker"] == "other-worker" and result["finish_reason"] == "length"
    assert h.client.kinds(rid).count("result") == 1
    row = (await h.rows([rid]))[rid]
    assert row["status"] == "completed" and row["output_text"] == other.output_text
    assert row["worker_id"] == "other-worker" and row["completion_tokens"] == 3

    async def acked() -> bool:
        _, unacked = await queue_counts(h.amqp_url, h.topo.queue)
        return unacked == 0 and await h.ready_count() == 0

    await eventually(acked, "the message to be acked", timeout=20)
    assert await h.dead_letter_count() == 0
    assert "was recorded first" in w.output()


# -- 6. bad input --

MAX_TOKENS_CAP = 64


def _bad_inputs() -> dict[str, tuple[bytes, str]]:
    """case -> (body, expected error code)."""

    def pack(**fields: Any) -> bytes:
        return msgpack.packb(fields, use_bin_type=True)

    return {
        "not-msgpack": (b"\xc1\xc1 this is not msgpack", "invalid_request"),
        "wrong-type": (pack(prompt="hi", max_tokens="10"), "invalid_request"),
        "no-prompt": (pack(max_tokens=4), "invalid_request"),
        "two-prompts": (pack(prompt="hi", prompt_token_ids=[1, 2]), "invalid_request"),
        "unknown-field": (pack(prompt="hi", colour="blue"), "invalid_request"),
        "too-long": (pack(prompt_token_ids=[100] * 2000), "prompt_too_long"),
        "over-cap": (pack(prompt="hi", max_tokens=MAX_TOKENS_CAP + 1), "invalid_request"),
        "temperature": (pack(prompt="hi", temperature=-1.0), "invalid_request"),
        "top-p": (pack(prompt="hi", top_p=2.0), "invalid_request"),
        "oversized": (pack(prompt="x" * ((1 << 20) + 1000)), "invalid_request"),
        "nul-in-id": (pack(id="a\x00b", prompt="hi"), "invalid_request"),
        "max-tokens-past-context": (pack(prompt="hi", max_tokens=10**9), "invalid_request"),
        "priority-past-int32": (pack(prompt="hi", priority=2**31), "invalid_request"),
    }


@pytest.mark.timeout(90)
async def test_bad_input_is_answered_recorded_and_dead_lettered(
    harness: Harness, tiny_dir: Path
) -> None:
    h = harness
    w = h.start(
        "bad",
        model=tiny_dir,
        max_num_seqs=4,
        extra=["--max-model-len", "256", "--max-tokens-cap", str(MAX_TOKENS_CAP)],
    )
    await h.ready(w)

    cases = _bad_inputs()
    ids = {case: f"bad-{case}-{uuid.uuid4().hex[:6]}" for case in cases}
    for case, (body, _) in cases.items():
        await h.publish_raw(body, ids[case])

    async def all_answered() -> bool:
        return all(h.client.replies.get(rid) for rid in ids.values())

    await eventually(all_answered, "an error reply for every bad request", timeout=30)
    rows = await h.settled(list(ids.values()))
    dead = await h.dead_letters(set(ids.values()))

    for case, (body, code) in cases.items():
        rid = ids[case]
        replies = h.client.replies[rid]
        assert [r["type"] for r in replies] == ["error"], f"{case}: {replies}"
        assert replies[0]["error"]["code"] == code, f"{case}: {replies[0]}"
        assert replies[0]["error"]["message"], case
        assert rows[rid]["status"] == "rejected", f"{case}: {rows[rid]}"
        assert rows[rid]["error_code"] == code, case
        assert dead[rid] == body, f"{case}: the dead letter is not the original message"

    assert w.alive(), w.tail()
    good = await (await h.client.submit("Still there?", max_tokens=4)).result(30)
    assert good["type"] == "result" and good["usage"]["completion_tokens"] >= 1
    # U+0000 is no bad input: served, echoed as sent, stored as U+FFFD
    nul = await h.client.submit("Still\x00 there?", max_tokens=4, metadata={"k": "a\x00b"})
    served = await nul.result(30)
    assert served["type"] == "result" and served["metadata"] == {"k": "a\x00b"}
    row = (await h.settled([nul.id]))[nul.id]
    assert row["status"] == "completed" and row["prompt"] == "Still\ufffd there?"
    assert row["metadata"] == {"k": "a\ufffdb"}
    assert await h.ready_count() == 0


@pytest.mark.timeout(90)
async def test_logprobs_travel_in_deltas_and_the_result(harness: Harness, tiny_dir: Path) -> None:
    h = harness
    w = h.start("lp", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)
    asked = await h.client.submit(
        prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True, logprobs=2, stream=True
    )
    plain = await h.client.submit(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
    result = await asked.result(60)
    deltas = [r for r in h.client.replies[asked.id] if r["type"] == "delta"]
    lps = result["logprobs"]
    assert [e["token_id"] for e in lps] == result["token_ids"]
    assert [e["token_id"] for d in deltas for e in d["logprobs"]] == result["token_ids"]
    for e in lps:
        assert e["logprob"] <= 0 and len(e["top"]) == 2
        assert e["top"][0][1] >= e["top"][1][1]  # best first
    assert "logprobs" not in await plain.result(60)


# -- 7. deadlines --


@pytest.mark.timeout(90)
async def test_requests_past_their_deadline_are_not_run(harness: Harness, tiny_dir: Path) -> None:
    h = harness
    w = h.start("late", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)

    # a deadline in the body that has passed
    past = await h.client.submit("too late", id="late-body", deadline=time.time() - 5)
    with pytest.raises(RequestFailed) as info:
        await past.result(30)
    assert info.value.code == "expired"

    # the AMQP expiration: 5 s after an enqueue time 30 s ago (the broker counts its
    # TTL from arrival, so it delivers; the worker must measure from the enqueue time)
    enqueued = time.time() - 30
    body = msgpack.packb({"prompt": "too late too", "max_tokens": 4}, use_bin_type=True)
    await h.publish_raw(
        body,
        "late-ttl",
        expiration=5,
        timestamp=enqueued,
        headers={ENQUEUED_AT_HEADER: f"{enqueued:.6f}"},
    )

    async def answered() -> bool:
        return bool(h.client.replies.get("late-ttl"))

    await eventually(answered, "a reply to the expired message", timeout=30)
    replies = h.client.replies["late-ttl"]
    assert [r["type"] for r in replies] == ["error"], replies
    assert replies[0]["error"]["code"] == "expired"

    rows = await h.settled(["late-body", "late-ttl"])
    for row in rows.values():
        assert row["status"] == "expired", row
        assert row["error_code"] == "expired"
        assert row["output_text"] is None and row["first_token_at"] is None, "it ran"
    assert await h.dead_letter_count() == 0
    assert await h.ready_count() == 0


async def test_a_request_queued_past_the_queue_delay_limit_is_answered_expired(
    harness: Harness, tiny_dir: Path
) -> None:
    """Admission control: with --max-queue-delay, a request that waited longer since it
    was enqueued is answered `expired` with the reason, and recorded so; a fresh one runs."""
    h = harness
    w = h.start("qdelay", model=tiny_dir, max_num_seqs=4, extra=["--max-queue-delay", "60"])
    await h.ready(w)
    enqueued = time.time() - 3600
    body = msgpack.packb({"prompt": "waited an hour", "max_tokens": 4}, use_bin_type=True)
    await h.publish_raw(
        body, "waited", timestamp=enqueued, headers={ENQUEUED_AT_HEADER: f"{enqueued:.6f}"}
    )
    fresh = await h.client.submit("fresh", id="fresh", max_tokens=4)
    assert (await fresh.result(60))["finish_reason"] == "length"

    async def answered() -> bool:
        return bool(h.client.replies.get("waited"))

    await eventually(answered, "a reply to the request that waited an hour", timeout=30)
    reply = h.client.replies["waited"]
    assert [r["type"] for r in reply] == ["error"], reply
    assert reply[0]["error"]["code"] == "expired"
    assert "--max-queue-delay" in reply[0]["error"]["message"]
    rows = await h.settled(["waited", "fresh"])
    assert rows["waited"]["status"] == "expired"
    assert "over this worker's limit of 60 s" in rows["waited"]["error"]
    assert rows["waited"]["first_token_at"] is None, "it ran"
    assert rows["fresh"]["status"] == "completed"


@pytest.mark.timeout(90)
async def test_request_whose_deadline_passes_while_held_is_not_run(
    harness: Harness, tiny_dir: Path
) -> None:
    h = harness
    # one sequence slot: the second request waits in the worker's look-ahead
    w = h.start("held", model=tiny_dir, max_num_seqs=1)
    await h.ready(w)

    h.hold()  # the slot stays busy until the second request has expired
    blocker = await h.client.submit(
        prompt_token_ids=[HOLD, 9, 9, 9], id="held-long", max_tokens=24, ignore_eos=True
    )

    async def long_running() -> bool:
        row = (await h.worker_rows()).get(w.id)
        return row is not None and (row["running"] or 0) == 1

    await eventually(long_running, "the long request to run", timeout=30, every=0.02)
    deadline = time.time() + 2.0
    waiting = await h.client.submit("wait for me", id="held-short", max_tokens=4, deadline=deadline)
    await h.settled(["held-short"])
    h.release()
    await blocker.result(60)
    rows = await h.settled(["held-long", "held-short"])
    row = rows["held-short"]
    # it reached the worker in time and then waited past its deadline there
    assert row["received_at"].timestamp() < deadline, "precondition: received before the deadline"
    assert rows["held-long"]["finished_at"].timestamp() > deadline, "precondition: slot was busy"
    assert row["status"] == "expired", row
    assert row["first_token_at"] is None and not row["completion_tokens"], "it ran"
    with contextlib.suppress(RequestFailed):
        await waiting.result(30)
    replies = h.client.replies["held-short"]
    assert [r["type"] for r in replies] == ["error"], f"not an error reply: {replies}"
    assert replies[0]["error"]["code"] == "expired", replies
    assert row["error_code"] == "expired", row


# -- 8. SIGTERM drain --


@pytest.mark.timeout(150)
async def test_sigterm_drains_and_requeues_to_the_other_worker(
    harness: Harness, default_model_dir: Path
) -> None:
    h = harness
    a = h.start("drain-a", model=None, max_num_seqs=3, extra=["--drain-timeout", "1"])
    b = h.start("drain-b", model=None, max_num_seqs=3)
    await h.ready(a, b)
    h.hold()  # what A runs cannot finish within its drain timeout
    handles = [
        await h.client.submit(
            prompt_token_ids=[HOLD, 1, 2, 3 + i], id=f"drain-{i}", max_tokens=96, ignore_eos=True
        )
        for i in range(6)
    ]

    async def a_busy() -> list[str]:
        rows = await h.rows()
        return [
            rid for rid, r in rows.items() if r["status"] == "running" and r["worker_id"] == a.id
        ]

    on_a = await eventually(a_busy, "requests running on worker A", timeout=30, every=0.02)

    a.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert await a.wait(20) == 0, a.tail()
    assert time.monotonic() - started < 1 + 10, "drain took too long"
    h.release()

    outcomes = await results(handles, timeout=120)
    rows = await h.settled([x.id for x in handles])
    assert await h.count_rows() == len(handles)
    assert await h.dead_letter_count() == 0, "a drained request was dead-lettered"
    requeued = [rows[rid] for rid in on_a if rows[rid]["worker_id"] == b.id]
    assert requeued, f"A finished all of {on_a} within its drain timeout: nothing was requeued"
    for handle, result in zip(handles, outcomes, strict=True):
        row = rows[handle.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 96, row
        assert h.client.kinds(handle.id) == ["result"], h.client.kinds(handle.id)
        assert result["worker"] == row["worker_id"]
    assert all(r["attempts"] >= 2 for r in requeued)
    assert (await h.worker_rows())[a.id]["state"] == "stopped"
    assert "Traceback" not in a.output(), a.tail()


# -- 9. refusing to start --


@pytest.mark.timeout(120)
async def test_worker_refuses_an_unmigrated_database(
    amqp_url: str,
    rabbit_topology: Topology,
    empty_schema: Callable[[], str],
    tiny_dir: Path,
    tmp_path: Path,
) -> None:
    url = empty_schema()  # never migrated
    wid = "unmigrated"
    cmd = worker_command(amqp_url, rabbit_topology.queue, url, wid, model=tiny_dir, max_num_seqs=2)
    w = spawn(cmd, wid, tmp_path, rabbit_topology.exchange)
    try:
        code = await w.wait(60)
        out = w.output()
    finally:
        await w.stop()
    assert code != 0, out
    assert "kvflow db upgrade" in out, out
    assert "Traceback" not in out, out


@pytest.mark.timeout(120)
async def test_worker_exits_clearly_when_rabbitmq_is_unreachable(
    harness: Harness, tiny_dir: Path
) -> None:
    password = "s3cret-" + uuid.uuid4().hex[:8]
    url = f"amqp://guest:{password}@127.0.0.1:1/"
    w = harness.start("norabbit", model=tiny_dir, max_num_seqs=2, amqp_url=url)
    code = await w.wait(60)
    out = w.output()
    assert code != 0, out
    assert "cannot reach RabbitMQ" in out and "127.0.0.1:1" in out, out
    assert password not in out, "the password leaked"
    assert "Traceback" not in out, out
