"""Every delivery accounted for at the edges of the contract: the same id from two
producers, floods of copies, producer-controlled time, requeues near the delivery limit,
a poison message, and a request that outlives RabbitMQ's consumer timeout.

Real RabbitMQ and PostgreSQL, workers as subprocesses (tests/integration/harness.py);
held requests (the engine's test hook) keep work in flight for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import msgpack
import pytest

from broker import lenient
from broker.topology import DEFAULT_CONTROL_EXCHANGE, Topology
from tests.integration.harness import (
    HOLD,
    LOOKAHEAD,
    Harness,
    HeldSampler,
    RecordingClient,
    results,
)
from tests.integration.helpers import eventually
from tests.integration.rawamqp import HUGE_TIME, PLACEHOLDER_TIME, Patch, RawPublisher
from worker.ledger.migrate import upgrade_async

pytestmark = pytest.mark.integration

CRASH = 31337  # a prompt holding this token kills the engine process (the test hook)
PLACEHOLDER_BYTES = int(PLACEHOLDER_TIME.timestamp()).to_bytes(8, "big")


def body(rid: str, **fields: Any) -> bytes:
    data: dict[str, Any] = {"id": rid, **fields}
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


# -- the same id, more than once -------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_two_producers_sending_one_id_both_get_the_outcome(
    harness: Harness, tiny_dir: Path
) -> None:
    """A retry from a restarted producer (its own reply queue) arrives while the first
    copy runs: both producers get the one final outcome; one run, one row."""
    h = harness
    w = h.start("twins", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)
    other = await RecordingClient.connect(h.amqp_url, topology=h.topo)
    try:
        h.hold()
        rid = "twin-" + uuid.uuid4().hex[:6]
        first = await h.client.submit(
            prompt_token_ids=[HOLD, 5, 6], id=rid, max_tokens=8, ignore_eos=True, stream=True
        )
        await eventually(lambda: _has(h.client, rid, "delta"), "the first copy to run")
        second = await other.submit(prompt_token_ids=[HOLD, 5, 6], id=rid, max_tokens=8)

        async def both_held() -> bool:
            row = (await h.worker_rows()).get(w.id)
            return row is not None and (row["info"] or {}).get("held", 0) >= 2

        await eventually(both_held, "the second copy to be held by the worker")
        h.release()
        a, b = await asyncio.gather(first.result(60), second.result(60))
    finally:
        await other.close()
    assert a["type"] == b["type"] == "result"
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
    assert [r["type"] for r in other.replies[rid]] == ["result"]
    row = (await h.settled([rid]))[rid]
    assert row["status"] == "completed" and row["attempts"] == 1, row
    assert await h.ready_count() == 0 and await h.dead_letter_count() == 0


@pytest.mark.timeout(120)
async def test_a_malformed_copy_of_a_running_id_does_not_end_it(
    harness: Harness, tiny_dir: Path
) -> None:
    """A bad body under the id of a request being served (a buggy or hostile producer):
    the bad message is answered and dead-lettered, the request runs on to its own
    outcome; and a bad body under an id that already ended is answered with that outcome."""
    h = harness
    w = h.start("badcopy", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)
    h.hold()
    rid = "good-" + uuid.uuid4().hex[:6]
    good = await h.client.submit(
        prompt_token_ids=[HOLD, 8], id=rid, max_tokens=3, ignore_eos=True, stream=True
    )
    await eventually(lambda: _has(h.client, rid, "delta"), "the valid request to run")
    other = await RecordingClient.connect(h.amqp_url, topology=h.topo)  # another producer
    try:
        bad = body(rid, prompt="x", temperature="hot")
        await _publish_to(h, other, bad, rid)
        await eventually(lambda: _has(other, rid, "error"), "the bad copy to be answered")
        h.release()
        result = await good.result(60)
        assert result["type"] == "result" and len(result["token_ids"]) == 3
        row = (await h.settled([rid]))[rid]
        assert row["status"] == "completed", row
        await h.dead_letters({rid})
        # once it has ended, a bad copy is answered with what the ledger keeps
        await _publish_to(h, other, bad, rid)
        await eventually(lambda: _has(other, rid, "result"), "the ledger's outcome")
        assert other.replies[rid][-1]["text"] == result["text"]
    finally:
        await other.close()
    assert (await h.rows([rid]))[rid]["status"] == "completed"


async def _publish_to(h: Harness, replies: RecordingClient, payload: bytes, rid: str) -> None:
    message = aio_pika.Message(
        payload,
        content_type="application/msgpack",
        message_id=rid,
        correlation_id=rid,
        reply_to=replies.reply_queue,
    )
    await h.exchange.publish(message, routing_key=h.topo.queue, mandatory=True)


@pytest.mark.timeout(150)
async def test_a_flood_of_copies_of_one_id_is_held_within_the_worker_limit(
    harness: Harness, tiny_dir: Path
) -> None:
    """Copies of an id being served are parked, and count against what a worker holds:
    a thousand copies never sit in one worker's memory at once."""
    h = harness
    max_seqs, copies = 2, 60
    w = h.start("flood", model=tiny_dir, max_num_seqs=max_seqs)
    await h.ready(w)
    h.hold()
    rid = "flood-" + uuid.uuid4().hex[:6]
    first = await h.client.submit(
        prompt_token_ids=[HOLD, 1, 2], id=rid, max_tokens=4, ignore_eos=True, stream=True
    )
    await eventually(lambda: _has(h.client, rid, "delta"), "the first copy to run")
    cap = max_seqs + LOOKAHEAD
    async with HeldSampler(h) as held:
        for _ in range(copies):
            await h.publish_raw(body(rid, prompt_token_ids=[HOLD, 1, 2], max_tokens=4), rid)

        async def full() -> bool:
            return held.max_held[w.id] >= cap and await h.ready_count() == copies - (cap - 1)

        await eventually(full, "the worker to hold as many copies as it may", timeout=60)
        for _ in range(10):  # it stays there while the first copy is held
            await asyncio.sleep(0.05)
        assert await h.ready_count() == copies - (cap - 1)
        h.release()
        await first.result(60)

        async def all_settled() -> bool:
            return await h.ready_count() == 0 and held.max_held[w.id] <= cap

        await eventually(all_settled, "every copy to be settled", timeout=90)
    assert held.max_held[w.id] <= cap, dict(held.max_held)
    assert await h.count_rows() == 1
    row = (await h.rows([rid]))[rid]
    assert row["status"] == "completed" and row["attempts"] == 1, row
    assert await h.dead_letter_count() == 0
    assert {r["type"] for r in h.client.replies[rid]} <= {"delta", "result"}


# -- producer-controlled time ------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_a_backdated_request_does_not_jump_the_queue(
    harness: Harness, tiny_dir: Path
) -> None:
    """The producer's timestamp measures queue delay only: the worker orders by its own
    receive time (a request stamped 2001 does not jump ahead), and an enqueue time later
    than the receive time is clamped to it."""
    h = harness
    w = h.start("time", model=tiny_dir, max_num_seqs=1)  # one slot; two wait in the look-ahead
    await h.ready(w)
    h.hold()
    blocker = await h.client.submit(
        prompt_token_ids=[HOLD, 1], id="time-blocker", max_tokens=2, stream=True
    )
    await eventually(lambda: _has(h.client, "time-blocker", "delta"), "the blocker to run")
    await h.publish_raw(body("time-fair", prompt_token_ids=[1, 2], max_tokens=2), "time-fair")
    old = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)
    await h.publish_raw(
        body("time-old", prompt_token_ids=[1, 3], max_tokens=2),
        "time-old",
        timestamp=old,
        headers={"x-enqueued-at": str(old.timestamp())},
    )

    ids = ["time-fair", "time-old"]

    async def both_received() -> bool:
        return len(await h.rows(ids)) == len(ids)

    await eventually(both_received, "both requests to reach the worker")
    h.release()
    await blocker.result(60)
    rows = await h.settled(ids)
    fair, backdated = rows["time-fair"], rows["time-old"]
    assert fair["admitted_at"] < backdated["admitted_at"], rows
    assert backdated["enqueued_at"] == old  # kept: it is what the producer says

    future = dt.datetime(2090, 1, 1, tzinfo=dt.UTC)
    await h.publish_raw(
        body("time-future", prompt_token_ids=[1, 4], max_tokens=2),
        "time-future",
        timestamp=future,
        headers={"x-enqueued-at": str(future.timestamp())},
    )
    ahead = (await h.settled(["time-future"]))["time-future"]
    assert ahead["enqueued_at"] == ahead["received_at"]  # clamped to the worker's clock
    waited = (ahead["admitted_at"] - ahead["received_at"]).total_seconds()
    assert ahead["queue_s"] == pytest.approx(waited, abs=1e-5)  # timestamps: microseconds


# -- malformed AMQP properties ----------------------------------------------------------------


@pytest.mark.timeout(150)
async def test_malformed_properties_cost_only_their_message(
    harness: Harness, tiny_dir: Path
) -> None:
    """Properties no client library would send (not UTF-8, a timestamp past the year
    9999), published as raw frames to the request queue and to
    the control plane, while other requests are in flight: the worker's connection stays
    up (nothing in flight is redelivered), each bad message is answered or dead-lettered,
    the others run."""
    h = harness
    lenient.install()  # this test reads the malformed messages back from the dead letters
    w = h.start("raw", model=tiny_dir, max_num_seqs=4)
    await h.ready(w)
    h.hold()
    held = await h.client.submit(
        prompt_token_ids=[HOLD, 7], id="raw-held", max_tokens=3, ignore_eos=True, stream=True
    )
    await eventually(lambda: _has(h.client, "raw-held", "delta"), "a request in flight")
    reply = {"reply_to": h.client.reply_queue}
    raw = await RawPublisher.connect(h.amqp_url)
    try:
        q = h.topo.queue
        good = body("raw-mid", prompt_token_ids=[1, 2], max_tokens=2)
        # a request whose AMQP message_id is not UTF-8 (its body's id is fine)
        await raw.publish(
            "", q, good, {**reply, "message_id": "MMMM"}, (Patch(b"MMMM", b"\xff\xfe\xfd\xfc"),)
        )
        # no body id, and a message_id that is not UTF-8: invalid, dead-lettered
        await raw.publish(
            "",
            q,
            msgpack.packb({"prompt": "x"}),
            {**reply, "message_id": "NNNN", "correlation_id": "raw-noid"},
            (Patch(b"NNNN", b"\xc3\x28\xa0\xa1"),),
        )
        # a timestamp past the year 9999
        await raw.publish(
            "",
            q,
            body("raw-time", prompt_token_ids=[1, 3], max_tokens=2),
            {**reply, "timestamp": PLACEHOLDER_TIME},
            (Patch(PLACEHOLDER_BYTES, HUGE_TIME),),
        )
        # a header key that is not UTF-8, and a reply_to that is not either
        await raw.publish(
            "",
            q,
            body("raw-header", prompt_token_ids=[1, 4], max_tokens=2),
            {"headers": {"KKKK": 1}, "reply_to": "RRRR"},
            (Patch(b"KKKK", b"\xff\xff\xff\xff"), Patch(b"RRRR", b"\xfe\xfe\xfe\xfe")),
        )
        # and on the control plane, which every worker listens to
        await raw.publish(
            DEFAULT_CONTROL_EXCHANGE,  # the workers listen on the default one
            "",
            b"\x00",
            {"message_id": "CCCC"},
            (Patch(b"CCCC", b"\xff" * 4),),
        )
    finally:
        await raw.close()
    served = ["raw-mid", "raw-time", "raw-header"]
    rows = await h.settled(served)
    for rid in served:
        assert rows[rid]["status"] == "completed", rows[rid]
    assert [r["type"] for r in h.client.replies["raw-mid"]][-1] == "result"
    dead: list[str | None] = []

    async def dead_lettered() -> bool:
        while (m := await h.dead.get(no_ack=True, fail=False)) is not None:
            dead.append(m.correlation_id)
        return "raw-noid" in dead

    await eventually(dead_lettered, "the message without a usable id in the dead-letter queue")
    assert dead == ["raw-noid"], dead
    h.release()
    result = await held.result(60)
    assert result["type"] == "result"
    row = (await h.settled(["raw-held"]))["raw-held"]
    assert row["attempts"] == 1, "the request in flight was redelivered: the connection dropped"
    assert w.alive(), w.tail()
    pong = await h.client.submit(prompt_token_ids=[1, 6], max_tokens=1)
    assert (await pong.result(30))["type"] == "result"


# -- the delivery limit ---------------------------------------------------------------------------


@pytest.fixture
async def limited(
    amqp_url: str,
    rabbit_topology: Topology,
    empty_schema: Callable[[], str],
    tmp_path: Path,
) -> AsyncIterator[Harness]:
    """A harness on a queue that allows one redelivery (x-delivery-limit 1)."""
    url = empty_schema()
    await upgrade_async(url)
    h = Harness(amqp_url, dataclasses.replace(rabbit_topology, delivery_limit=1), url, tmp_path)
    try:
        await h.open()
        yield h
    finally:
        await h.close()


@pytest.mark.timeout(150)
async def test_a_request_drained_to_the_delivery_limit_ends_failed_not_dropped(
    limited: Harness, tiny_dir: Path
) -> None:
    """Each drain returns the request to the queue, which counts toward the delivery
    limit; the last delivery the queue allows ends it failed, recorded and answered,
    instead of the broker dropping it while the ledger says 'running'."""
    h = limited
    args = ["--delivery-limit", "1", "--drain-timeout", "0.2"]
    h.hold()
    rid = "drained-" + uuid.uuid4().hex[:6]
    handle = await h.client.submit(
        prompt_token_ids=[HOLD, 1, 2], id=rid, max_tokens=4, ignore_eos=True, stream=True
    )
    a = h.start("limit-a", model=tiny_dir, max_num_seqs=2, extra=args)
    await h.ready(a)
    await eventually(lambda: _has(h.client, rid, "delta"), "the request to run")
    a.proc.terminate()
    assert await a.wait(30) == 0, a.tail()

    b = h.start("limit-b", model=tiny_dir, max_num_seqs=2, extra=args)
    await h.ready(b)
    row = (await h.settled([rid]))[rid]
    assert row["status"] == "failed" and row["error_code"] == "internal", row
    assert "delivery limit" in row["error"], row
    with pytest.raises(Exception, match="delivery limit"):
        await handle.result(30)
    dead = await h.dead_letters({rid})
    assert rid in dead  # kept for `kvflow dlq replay`, dead-lettered by the worker
    assert h.client.kinds(rid).count("error") == 1


# -- a poison message -------------------------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_a_poison_message_ends_failed_and_its_batch_mates_complete(
    harness: Harness, tiny_dir: Path
) -> None:
    """A request that kills the engine process whenever it runs: it ends failed within
    the delivery limit; the requests that were in the batch with it complete, and are
    not charged a delivery for its crashes."""
    h = harness
    h.hold()
    mates = [
        await h.client.submit(
            prompt_token_ids=[HOLD, 2, 3 + i],
            id=f"mate-{i}",
            max_tokens=6,
            ignore_eos=True,
            stream=True,
        )
        for i in range(3)
    ]
    first = h.start("poison-0", model=tiny_dir, max_num_seqs=4, crash_token=CRASH)
    await h.ready(first)
    for m in mates:
        await eventually(lambda m=m: _has(h.client, m.id, "delta"), "the batch to run")
    poison = await h.client.submit(prompt_token_ids=[CRASH, 1], id="poison", max_tokens=4)
    assert await first.wait(60) == 1, first.tail()
    h.release()

    # The test stands in for the supervisor: a worker whose engine died exits 1 and
    # another takes over, until every request has its outcome.
    starts = 1
    ids = ["poison", *(m.id for m in mates)]
    while True:
        rows = await h.rows(ids)
        if len(rows) == len(ids) and all(
            r["status"] not in ("running", "queued") for r in rows.values()
        ):
            break
        assert starts < 6, f"still unsettled after {starts} workers: {rows}"
        w = h.start(f"poison-{starts}", model=tiny_dir, max_num_seqs=4, crash_token=CRASH)
        starts += 1
        await h.ready(w)
        done = await _first_of(w, h, ids)
        if not done:
            assert await w.wait(60) in (0, 1), w.tail()

    rows = await h.settled(ids)
    assert rows["poison"]["status"] == "failed", rows["poison"]
    assert "alone" in rows["poison"]["error"], rows["poison"]
    with pytest.raises(Exception, match="alone"):
        await poison.result(30)
    for m in mates:
        assert rows[m.id]["status"] == "completed", rows[m.id]
    outcomes = await results(mates, timeout=30)
    assert all(o["type"] == "result" for o in outcomes)
    dead = await h.dead_letters({"poison"})
    assert set(dead) == {"poison"}
    # not charged: the mates' messages went back as new ones, never counted by the broker
    assert await h.ready_count() == 0


async def _first_of(w: Any, h: Harness, ids: list[str]) -> bool:
    """Wait until the worker exits or every id is settled; True when settled."""

    async def either() -> str | None:
        if not w.alive():
            return "exited"
        rows = await h.rows(ids)
        if len(rows) == len(ids) and all(
            r["status"] not in ("running", "queued") for r in rows.values()
        ):
            return "settled"
        return None

    return await eventually(either, "the worker to exit or finish", timeout=90) == "settled"


# -- RabbitMQ's consumer timeout -----------------------------------------------------------------


@contextlib.contextmanager
def consumer_timeout(ms: int, tick_ms: int) -> Iterator[None]:
    """Set the node-wide consumer timeout (3.10 has no per-queue one) and how often new
    channels check it (every 60 s by default); put both back as they were afterwards."""

    def rabbit_eval(expr: str) -> str:
        done = subprocess.run(
            ["rabbitmqctl", "eval", expr], check=True, capture_output=True, text=True, timeout=60
        )
        return done.stdout.strip()

    # Both always have a value (the broker's channels need the tick interval), so they
    # are restored, never unset.
    before = {
        key: rabbit_eval(f"{{ok, V}} = application:get_env(rabbit, {key}), V.")
        for key in ("consumer_timeout", "channel_tick_interval")
    }
    rabbit_eval(
        f"application:set_env(rabbit, consumer_timeout, {ms}), "
        f"application:set_env(rabbit, channel_tick_interval, {tick_ms})."
    )
    try:
        yield
    finally:
        rabbit_eval(
            ", ".join(f"application:set_env(rabbit, {k}, {v})" for k, v in before.items()) + "."
        )


@pytest.mark.timeout(120)
async def test_a_long_request_ends_before_the_consumer_timeout_and_runs_once(
    harness: Harness, tiny_dir: Path
) -> None:
    """RabbitMQ closes a channel holding a delivery past consumer_timeout and redelivers
    it; a worker bounds each request's run below it, so even one that cannot finish
    (held here) ends once, with finish reason 'deadline', and is never run twice."""
    h = harness
    with consumer_timeout(ms=3000, tick_ms=200):
        w = h.start("long", model=tiny_dir, max_num_seqs=2, extra=["--max-request-seconds", "1.5"])
        await h.ready(w)
        h.hold()
        handle = await h.client.submit(
            prompt_token_ids=[HOLD, 4, 5], id="long-one", max_tokens=50, ignore_eos=True
        )
        result = await handle.result(60)
        started = time.monotonic()
        while time.monotonic() - started < 4:  # past the timeout: no redelivery comes
            await asyncio.sleep(0.2)
        row = (await h.settled(["long-one"]))["long-one"]
    assert result["finish_reason"] == "deadline" and 0 < len(result["token_ids"]) < 50
    assert row["status"] == "expired" and row["attempts"] == 1, row
    assert h.client.kinds("long-one").count("result") == 1
    assert await h.ready_count() == 0 and await h.dead_letter_count() == 0
    assert "PRECONDITION_FAILED" not in w.output() and w.alive(), w.tail()


def _has(client: RecordingClient, rid: str, kind: str) -> Any:
    async def check() -> bool:
        return kind in client.kinds(rid)

    return check()
