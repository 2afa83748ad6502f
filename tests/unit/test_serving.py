"""The delivery pieces in process: drain state, flow control, intake accounting, settlement.

The broker, the ledger and the reply channel are stand-ins recording what they were
asked to do (the integration tests run the same code against RabbitMQ and PostgreSQL).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.messages import CRASHES_HEADER, decode_reply
from worker.engine.engine import Capacity
from worker.ledger import RequestRecord, RequestSource
from worker.metrics import Metrics
from worker.outcome import Outcome
from worker.records import Origin, error_record
from worker.serving.drain import DrainState, GiveBack
from worker.serving.intake import FlowControl, QueueIntake
from worker.serving.isolation import Isolation
from worker.serving.lanes import metric_label
from worker.serving.replies import Address, Replier, error_body
from worker.serving.settlement import Return, Settlement

# -- stand-ins -----------------------------------------------------------------------------


@dataclass
class FakeMessage:
    """Records how it was settled."""

    tag: int
    events: list[tuple[str, int]]
    redelivered: bool = False
    headers: dict[str, Any] = field(default_factory=dict)
    on_settle: Any = None  # the fake broker's hook

    def _settle(self, event: str) -> None:
        self.events.append((event, self.tag))
        if self.on_settle is not None:
            self.on_settle()

    async def ack(self) -> None:
        self._settle("ack")

    async def nack(self, requeue: bool = True) -> None:
        self._settle("requeue" if requeue else "nack")

    async def reject(self, requeue: bool = False) -> None:
        self._settle("dead-letter")


@dataclass
class FakePublisher:
    events: list[tuple[str, Any]]

    async def publish(self, reply_to: str, correlation_id: str | None, body: bytes) -> bool:
        self.events.append(("reply", (reply_to, correlation_id, decode_reply(body))))
        return True


@dataclass
class FakeLedger:
    """Commits on request; a terminal record returns the row the ledger keeps (the first
    terminal record of an id wins)."""

    events: list[tuple[str, Any]]
    rows: dict[str, RequestRecord] = field(default_factory=dict)

    def record(self, rec: RequestRecord) -> asyncio.Future[RequestRecord | None]:
        self.events.append(("commit", rec.id))
        kept = self.rows.setdefault(rec.id, rec)
        fut: asyncio.Future[RequestRecord | None] = asyncio.get_running_loop().create_future()
        fut.set_result(kept)
        return fut

    async def record_if_new(self, rec: RequestRecord) -> RequestRecord:
        self.events.append(("commit-if-new", rec.id))
        return self.rows.setdefault(rec.id, rec)


def settlement(events: list[Any], ledger: FakeLedger | None = None) -> Settlement:
    ledger = ledger or FakeLedger(events)
    return Settlement(
        ledger,  # type: ignore[arg-type]
        Replier(FakePublisher(events)),  # type: ignore[arg-type]
        Metrics("w", "m"),
        delivery_limit=3,
    )


def failed_record(rid: str, worker: str = "w") -> RequestRecord:
    return error_record(rid, Outcome.internal("boom"), Origin(worker, RequestSource.QUEUE))


def body_of(rid: str) -> bytes:
    return error_body(rid, Outcome.internal("boom"))


# -- drain state ---------------------------------------------------------------------------


async def test_drain_state_pause_resume_give_back_and_cancel() -> None:
    d = DrainState(keep_cancelled=2)
    assert d.paused and d.accepting  # paused until the worker starts serving
    d.resume()
    assert not d.paused
    d.give_back(["a", "b"])
    d.give_back(["c"], GiveBack.CRASHED)
    assert not d.accepting and d.given_back("a") is GiveBack.REQUEUE
    assert d.given_back("c") is GiveBack.CRASHED and d.given_back("x") is None
    d.forget("a")
    assert d.given_back("a") is None
    d.resume()
    assert d.accepting
    for rid in ("x", "y", "z"):
        d.cancel_on_arrival(rid)
    assert not d.take_cancelled("x"), "the oldest remembered cancel is forgotten first"
    assert d.take_cancelled("y") and not d.take_cancelled("y")  # once
    assert d.take_cancelled("z")


# -- flow control and the intake ------------------------------------------------------------


def cap(running: int = 0, waiting: int = 0, free_blocks: int = 100, waiting_tokens: int = 0):
    return Capacity(
        free_blocks=free_blocks,
        total_blocks=100,
        block_size=16,
        running=running,
        waiting=waiting,
        free_seqs=max(0, 8 - running - waiting),
        waiting_tokens=waiting_tokens,
        kv_usage=0.0,
    )


def test_flow_control_keeps_kv_room_for_the_waiting_prompts_and_a_reserve() -> None:
    flow = FlowControl(max_held=6, reserve_blocks=4)
    assert flow.has_room(cap())
    assert not flow.has_room(cap(free_blocks=5, waiting_tokens=17))  # 80 - 17 < 64
    assert flow.has_room(cap(free_blocks=5, waiting_tokens=16))


class FakeQueue:
    """A queue as the broker serves it: a consumer gets at most `prefetch` messages
    unsettled (acked, nacked or rejected) at a time; basic.get takes one."""

    def __init__(self, messages: list[FakeMessage], prefetch: int) -> None:
        self.messages = messages
        self.prefetch = prefetch
        self.unsettled = 0
        self.consumers: dict[str, asyncio.Task[None]] = {}
        self.deliveries: set[asyncio.Task[None]] = set()
        self.room = asyncio.Event()
        for m in messages:
            m.on_settle = self._settled

    def _settled(self) -> None:
        self.unsettled -= 1
        self.room.set()

    async def consume(self, callback: Any, no_ack: bool = False) -> str:
        async def push() -> None:
            while True:
                while self.messages and self.unsettled < self.prefetch:
                    self.unsettled += 1
                    task = asyncio.create_task(callback(self.messages.pop(0)))
                    self.deliveries.add(task)
                    task.add_done_callback(self.deliveries.discard)
                self.room.clear()
                await self.room.wait()

        tag = f"ctag-{len(self.consumers)}"
        self.consumers[tag] = asyncio.create_task(push())
        return tag

    async def cancel(self, tag: str) -> None:
        self.consumers.pop(tag).cancel()

    async def get(self, **_: Any) -> FakeMessage | None:
        if not self.messages:
            return None
        self.unsettled += 1
        return self.messages.pop(0)


class FakeEngine:
    def __init__(self) -> None:
        self.cap = cap()

    def capacity(self) -> Capacity:
        return self.cap


def intake_for(
    queue: FakeQueue, engine: FakeEngine, drain: DrainState, events: list[Any], deliver: Any
) -> QueueIntake:
    return QueueIntake(
        queue,  # type: ignore[arg-type]
        engine,  # type: ignore[arg-type]
        FlowControl(max_held=queue.prefetch, reserve_blocks=1),
        drain,
        settlement(events),
        Metrics("w", "m"),
        deliver,
        poll_max_s=0.01,
        burst=True,
    )


async def test_intake_holds_each_message_until_settled_and_stops_consuming_without_kv_room() -> (
    None
):
    events: list[Any] = []
    queue = FakeQueue([FakeMessage(i, events) for i in range(10)], prefetch=3)
    engine = FakeEngine()
    release = asyncio.Event()
    most_held = 0

    async def deliver(message: Any, admitted: Any) -> None:
        nonlocal most_held
        most_held = max(most_held, intake.held)
        await release.wait()  # settled only when the test says so
        await message.ack()

    drain = DrainState()
    drain.resume()
    intake = intake_for(queue, engine, drain, events, deliver)
    run = asyncio.create_task(intake.run())
    while intake.held < 3:
        await asyncio.sleep(0)
    for _ in range(20):  # the window is full: nothing more arrives
        await asyncio.sleep(0)
    assert intake.held == 3 and len(queue.messages) == 7
    engine.cap = cap(free_blocks=0)  # no KV room: the consumer is cancelled
    intake.capacity_changed()
    while queue.consumers:
        await asyncio.sleep(0)
    release.set()
    while intake.held:
        await asyncio.sleep(0)
    assert len(queue.messages) == 7, "it consumed without KV room"
    engine.cap = cap()
    intake.capacity_changed()
    await asyncio.wait_for(run, 10)  # burst: ends once the queue is empty and all settled
    assert intake.pulled == 10 and intake.held == 0 and most_held <= 3
    assert sorted(tag for what, tag in events if what == "ack") == list(range(10))


async def test_intake_gives_back_a_message_delivered_as_a_drain_began() -> None:
    events: list[Any] = []
    drain = DrainState()
    drain.resume()
    delivered: list[Any] = []

    class PausingQueue(FakeQueue):
        async def consume(self, callback: Any, no_ack: bool = False) -> str:
            async def late(message: Any) -> None:
                drain.pause()  # the drain comes while this delivery is on its way
                await callback(message)

            return await super().consume(late, no_ack)

    async def deliver(message: Any, admitted: Any) -> None:
        delivered.append(message)

    queue = PausingQueue([FakeMessage(1, events)], prefetch=3)
    intake = intake_for(queue, FakeEngine(), drain, events, deliver)
    intake.burst = False
    run = asyncio.create_task(intake.run())

    async def settled() -> None:
        while not events and not run.done():
            await asyncio.sleep(0)

    await asyncio.wait_for(settled(), 10)
    intake.stop()
    await asyncio.wait_for(run, 10)
    assert events == [("requeue", 1)] and not delivered


# -- settlement ----------------------------------------------------------------------------


async def test_conclude_commits_then_replies_then_acks() -> None:
    events: list[Any] = []
    s = settlement(events)
    assert s.claim("r1")
    to = Address("r1", "replies", "c1")
    await s.conclude(FakeMessage(1, events), to, failed_record("r1"), body_of("r1"))  # type: ignore[arg-type]
    assert [e[0] for e in events] == ["commit", "reply", "ack"]


async def test_parked_copies_are_answered_at_their_own_address_and_acked() -> None:
    events: list[Any] = []
    s = settlement(events)
    assert s.claim("r1") and not s.claim("r1")
    first = Address("r1", "replies-a", "c1")
    copies = [
        asyncio.create_task(s.park("r1", FakeMessage(2, events), Address("r1", "replies-b", "c2"))),  # type: ignore[arg-type]
        asyncio.create_task(s.park("r1", FakeMessage(3, events), Address("r1", "replies-a", "c1"))),  # type: ignore[arg-type]
        asyncio.create_task(s.park("r1", FakeMessage(4, events), Address("r1", None, None))),  # type: ignore[arg-type]
    ]
    await asyncio.sleep(0)
    await s.conclude(FakeMessage(1, events), first, failed_record("r1"), body_of("r1"))  # type: ignore[arg-type]
    await s.release("r1")
    await asyncio.wait_for(asyncio.gather(*copies), 5)
    replies = [to for what, to in events if what == "reply"]
    assert sorted((r[0], r[1]) for r in replies) == [("replies-a", "c1"), ("replies-b", "c2")]
    assert all(r[2]["error"]["code"] == "internal" for r in replies)
    assert sorted(tag for what, tag in events if what == "ack") == [1, 2, 3, 4]
    assert s.claim("r1"), "the id is free again once released"


async def test_copies_not_settled_with_the_first_go_back_to_the_queue() -> None:
    events: list[Any] = []
    s = settlement(events)
    assert s.claim("r1")
    copy = asyncio.create_task(s.park("r1", FakeMessage(2, events), Address("r1", "q", "c")))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    await s.requeue(FakeMessage(1, events), "r1")  # type: ignore[arg-type]
    await s.release("r1")
    await asyncio.wait_for(copy, 5)
    assert sorted(events) == [("requeue", 1), ("requeue", 2)]


async def test_the_reply_is_the_outcome_the_ledger_kept() -> None:
    events: list[Any] = []
    ledger = FakeLedger(events)
    ledger.rows["r1"] = RequestRecord(
        "r1", "completed", output_text="kept", output_token_ids=[7], worker_id="other"
    )
    s = settlement(events, ledger)
    # a bad body under an id that already completed: dead-lettered, answered with the outcome
    await s.reject(
        FakeMessage(1, events), Address("r1", "q", "c"), failed_record("r1"), body_of("r1")
    )  # type: ignore[arg-type]
    (reply,) = [to for what, to in events if what == "reply"]
    assert reply[2]["type"] == "result" and reply[2]["text"] == "kept"
    assert ("dead-letter", 1) in events


async def test_a_bad_copy_of_a_running_id_leaves_its_row_alone() -> None:
    events: list[Any] = []
    ledger = FakeLedger(events)
    running = RequestRecord("r1", "running", worker_id="other")
    ledger.rows["r1"] = running
    s = settlement(events, ledger)
    await s.reject(
        FakeMessage(1, events), Address("r1", "q", "c"), failed_record("r1"), body_of("r1")
    )  # type: ignore[arg-type]
    assert ledger.rows["r1"] is running
    (reply,) = [to for what, to in events if what == "reply"]
    assert reply[2]["type"] == "error"  # this message's own error: the request runs on
    assert ("dead-letter", 1) in events


@pytest.mark.parametrize("status", ["completed", "failed"])
async def test_replay_answers_from_the_row_and_acks(status: str) -> None:
    events: list[Any] = []
    s = settlement(events)
    row = RequestRecord("r1", status, output_text="t" if status == "completed" else None)
    await s.replay(FakeMessage(1, events), Address("r1", "q", "c"), row)  # type: ignore[arg-type]
    (reply,) = [to for what, to in events if what == "reply"]
    assert reply[2]["type"] == ("result" if status == "completed" else "error")
    assert events[-1] == ("ack", 1)


# -- giving deliveries back ----------------------------------------------------------------


@dataclass
class FakeRequeuer:
    events: list[tuple[str, Any]]
    fail: bool = False

    async def republish(self, message: Any, headers: Any) -> None:
        if self.fail:
            raise RuntimeError("not confirmed")
        self.events.append(("republish", (message.tag, dict(headers))))


def back(why: GiveBack, count: int = 0, crashes: int = 0) -> Return:
    return Return(
        why, "r1", count, crashes, Address("r1", "q", "c"), Origin("w", RequestSource.QUEUE)
    )


def settlement_with(events: list[Any], requeuer: FakeRequeuer | None = None) -> Settlement:
    return Settlement(
        FakeLedger(events),  # type: ignore[arg-type]
        Replier(FakePublisher(events)),  # type: ignore[arg-type]
        Metrics("w", "m"),
        delivery_limit=3,
        requeuer=requeuer,  # type: ignore[arg-type]
    )


async def test_a_requeue_counts_and_the_last_allowed_delivery_ends_failed() -> None:
    events: list[Any] = []
    s = settlement_with(events)
    await s.give_back(FakeMessage(1, events), back(GiveBack.REQUEUE, count=2))  # type: ignore[arg-type]
    assert events == [("requeue", 1)]
    events.clear()
    assert s.last_delivery(3) and not s.last_delivery(2)
    await s.give_back(FakeMessage(2, events), back(GiveBack.REQUEUE, count=3))  # type: ignore[arg-type]
    assert [e[0] for e in events] == ["commit", "reply", "dead-letter"]
    (reply,) = [to for what, to in events if what == "reply"]
    assert reply[2]["error"]["code"] == "internal"
    assert "delivery limit" in reply[2]["error"]["message"]


async def test_crash_suspects_go_back_as_new_messages_not_charged() -> None:
    events: list[Any] = []
    s = settlement_with(events, FakeRequeuer(events))
    await s.give_back(FakeMessage(1, events), back(GiveBack.CRASHED, count=2, crashes=0))  # type: ignore[arg-type]
    await s.give_back(FakeMessage(2, events), back(GiveBack.ENGINE_DOWN, count=2, crashes=1))  # type: ignore[arg-type]
    assert events == [
        ("republish", (1, {CRASHES_HEADER: 1})),
        ("ack", 1),
        ("republish", (2, {CRASHES_HEADER: 1})),  # not running when the engine died
        ("ack", 2),
    ]


async def test_a_suspect_that_crashes_the_engine_alone_ends_failed() -> None:
    events: list[Any] = []
    s = settlement_with(events, FakeRequeuer(events))
    await s.give_back(FakeMessage(1, events), back(GiveBack.CRASHED_ALONE, crashes=1))  # type: ignore[arg-type]
    assert [e[0] for e in events] == ["commit", "reply", "dead-letter"]


async def test_without_a_confirmed_republish_the_broker_requeues() -> None:
    events: list[Any] = []
    s = settlement_with(events, FakeRequeuer(events, fail=True))
    await s.give_back(FakeMessage(1, events), back(GiveBack.CRASHED))  # type: ignore[arg-type]
    assert events == [("requeue", 1)]


async def test_isolation_runs_a_suspect_alone_and_is_not_starved() -> None:
    iso = Isolation()
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a", "s", "b")}

    async def run(name: str, suspect: bool) -> None:
        async with iso.enter(suspect):
            order.append(f"+{name}")
            await release[name].wait()
            order.append(f"-{name}")

    a = asyncio.create_task(run("a", False))
    await asyncio.sleep(0)
    s = asyncio.create_task(run("s", True))  # waits for a to leave
    await asyncio.sleep(0)
    b = asyncio.create_task(run("b", False))  # waits behind the suspect
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["+a"]
    release["a"].set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["+a", "-a", "+s"] and iso.alone
    release["s"].set()
    release["b"].set()
    await asyncio.wait_for(asyncio.gather(a, s, b), 5)
    assert order == ["+a", "-a", "+s", "-s", "+b", "-b"] and not iso.alone


# -- fair mode's lanes ---------------------------------------------------------------------


# (the credit policy and the lane intake: tests/unit/test_lane_intake.py)


def test_metric_labels_stay_few() -> None:
    assert metric_label("a", ["a", "b"]) == "a"
    assert metric_label("default", ["a"]) == "default"
    assert metric_label("x-" * 20, ["a"]) == "other"
