"""Fair mode's intake in process: the credit policy (`Lanes.share`, `water_fill`) and the
mechanism (`LaneIntake`) against lanes served as RabbitMQ serves consumers with a window
of one message. The integration tests run the same code against RabbitMQ
(tests/integration/test_fair_sharing.py, the fair-mode restart in test_stress.py)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

from tests.unit.test_serving import FakeEngine, FakeMessage, cap, settlement
from worker.metrics import Metrics
from worker.serving.drain import DrainState
from worker.serving.intake import FlowControl
from worker.serving.lane_intake import LaneIntake
from worker.serving.lanes import Lanes, water_fill

# -- the policy ----------------------------------------------------------------------------


def test_water_fill_gives_one_each_then_by_weight_never_beyond_demand() -> None:
    weights = {"a": 1.0, "b": 3.0, "c": 1.0}
    assert water_fill(12, {"a": 100, "b": 100, "c": 1}, weights) == {"a": 3, "b": 8, "c": 1}
    # b asks for little: what it leaves goes to a
    assert water_fill(12, {"a": 100, "b": 2, "c": 1}, weights) == {"a": 9, "b": 2, "c": 1}
    assert water_fill(12, {"a": 2, "b": 2, "c": 0}, weights) == {"a": 2, "b": 2, "c": 0}
    # fewer units than clients asking: one each, in order, while they last
    assert water_fill(2, {"a": 5, "b": 5, "c": 5}, weights) == {"a": 1, "b": 1, "c": 0}
    for total in range(0, 30):
        got = water_fill(total, {"a": 7, "b": 40, "c": 3}, weights)
        assert sum(got.values()) == min(total, 50)
        assert all(got[c] <= d for c, d in {"a": 7, "b": 40, "c": 3}.items())


def test_a_lane_using_all_its_credits_doubles_until_the_window_is_shared() -> None:
    lanes = Lanes("q", {"a": 1.0, "b": 1.0})
    have = {"a": 0, "b": 0, "other": 0}
    for expected_a in (1, 2, 4, 8, 16, 18, 18):
        have = lanes.share(20, have, {"a": have["a"]}, now=0.0)  # a uses every credit
        assert have == {"a": expected_a, "b": 1, "other": 1}
    # b's first request uses its one credit: b doubles, a gives way, down to an even split
    for expected_b in (2, 4, 8, 9, 9):
        have = lanes.share(20, have, {"a": have["a"], "b": have["b"]}, now=0.0)
        assert have == {"a": 19 - expected_b, "b": expected_b, "other": 1}


def test_spare_credits_are_given_back_after_going_unused_for_a_while() -> None:
    lanes = Lanes("q", {"a": 1.0}, reclaim_s=1.0)
    have = {"a": 8, "other": 1}
    assert lanes.share(20, have, {"a": 3}, now=10.0)["a"] == 8  # kept: unused since now
    assert lanes.share(20, have, {"a": 5}, now=10.4)["a"] == 8
    assert lanes.share(20, have, {"a": 2}, now=10.9)["a"] == 8
    # 1 s with some unused: back to the most it used at once meanwhile, not the last count
    assert lanes.share(20, have, {"a": 2}, now=11.0)["a"] == 5
    assert lanes.share(20, {"a": 5, "other": 1}, {"a": 2}, now=11.5)["a"] == 5  # waits again
    assert lanes.share(20, {"a": 5, "other": 1}, {}, now=12.0)["a"] == 2
    assert lanes.share(20, {"a": 2, "other": 1}, {}, now=13.0)["a"] == 1  # one stays


def test_a_client_over_its_queued_token_limit_gets_no_credits() -> None:
    lanes = Lanes("q", {"a": 1.0, "b": 1.0}, max_queued_tokens=100)
    lanes.queue_tokens("a", 150)
    assert lanes.share(10, {"a": 4, "b": 4, "other": 1}, {"a": 4, "b": 4}, now=0.0)["a"] == 0
    lanes.queue_tokens("a", -100)
    assert lanes.share(10, {"a": 0, "b": 4, "other": 1}, {"b": 4}, now=0.0)["a"] == 1
    assert lanes.lane_of("stranger").client == "other"
    one = Lanes("q", {"a": 1.0}, lane_window=6)  # one lane at most a one-queue window
    assert one.share(20, {"a": 4, "other": 1}, {"a": 4}, now=0.0)["a"] == 6
    assert set(lanes.queues) == {"q.client.a", "q.client.b", "q.client.other"}


# -- the mechanism -------------------------------------------------------------------------


class Broker:
    """Lanes as RabbitMQ serves them to consumers of window one: a consumer gets a
    message while it holds none; a cancelled one gets no more, and what it holds stays
    unsettled until settled. Records the most messages unsettled at once."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.lanes: dict[str, FakeLane] = {}
        self.unsettled = 0
        self.most_unsettled = 0
        self.tags = itertools.count()

    async def declare_queue(self, name: str, passive: bool = False) -> FakeLane:
        assert passive, "the router declares the lanes; the intake only looks them up"
        return self.lanes.setdefault(name, FakeLane(self, name))

    def consumers(self, name: str) -> int:
        return len(self.lanes[name].consumers)


class FakeLane:
    def __init__(self, broker: Broker, name: str) -> None:
        self.broker, self.name = broker, name
        self.messages: list[FakeMessage] = []
        self.consumers: dict[str, tuple[Any, list[int]]] = {}  # tag -> (callback, [held])
        self.tasks: set[asyncio.Task[None]] = set()

    def publish(self, n: int) -> None:
        for _ in range(n):
            self.messages.append(FakeMessage(next(self.broker.tags), self.broker.events))
        self.pump()

    def pump(self) -> None:
        for callback, held in list(self.consumers.values()):
            if self.messages and not held[0]:
                message = self.messages.pop(0)
                held[0] = 1
                message.on_settle = lambda held=held: self._settled(held)
                self.broker.unsettled += 1
                self.broker.most_unsettled = max(self.broker.most_unsettled, self.broker.unsettled)
                task = asyncio.create_task(callback(message))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    def _settled(self, held: list[int]) -> None:
        held[0] = 0
        self.broker.unsettled -= 1
        self.pump()

    async def consume(self, callback: Any, no_ack: bool = False, consumer_tag: str = "") -> str:
        assert consumer_tag not in self.consumers
        self.consumers[consumer_tag] = (callback, [0])
        self.pump()
        return consumer_tag

    async def cancel(self, tag: str) -> None:
        self.consumers.pop(tag)

    async def get(self, **_: Any) -> FakeMessage | None:
        """basic.get: a message outside any consumer's window."""
        if not self.messages:
            return None
        message = self.messages.pop(0)
        message.on_settle = self._got_settled
        self.broker.unsettled += 1
        return message

    def _got_settled(self) -> None:
        self.broker.unsettled -= 1


def lane_intake(
    broker: Broker,
    lanes: Lanes,
    max_held: int,
    deliver: Any,
    *,
    engine: FakeEngine | None = None,
    metrics: Metrics | None = None,
    burst: bool = False,
    upstream_drained: Any = None,
) -> tuple[LaneIntake, DrainState]:
    """A lane intake on `broker`, serving (its drain state resumed); spare credits are
    never given back (its clock stands still)."""
    drain = DrainState()
    drain.resume()
    intake = LaneIntake(
        broker,  # type: ignore[arg-type]
        lanes,
        engine or FakeEngine(),
        FlowControl(max_held=max_held, reserve_blocks=1),
        drain,
        settlement(broker.events),
        metrics or Metrics("w", "m"),
        deliver,
        poll_max_s=0.01,
        burst=burst,
        clock=lambda: 0.0,
        upstream_drained=upstream_drained,
    )
    return intake, drain


async def settle_down(turns: int = 50) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_credits_bound_what_is_held_and_a_newcomer_gets_its_share() -> None:
    events: list[Any] = []
    broker = Broker(events)
    lanes = Lanes("q", {"a": 1.0, "b": 3.0})
    running: list[Any] = []  # delivered, not yet settled: the test settles them

    async def deliver(message: Any, admitted: Any) -> None:
        done = asyncio.Event()
        running.append((message, done))
        await done.wait()
        await message.ack()

    async def finish(n: int) -> None:  # the oldest n requests end
        for _, done in running[:n]:
            done.set()
        del running[:n]
        await settle_down()

    engine = FakeEngine()
    metrics = Metrics("w", "m")
    intake, drain = lane_intake(broker, lanes, 12, deliver, engine=engine, metrics=metrics)
    a = await broker.declare_queue("q.client.a", passive=True)
    b = await broker.declare_queue("q.client.b", passive=True)
    a.publish(60)
    run = asyncio.create_task(intake.run())
    await settle_down(200)
    # a alone: it doubles to the window, less one credit for each other lane
    assert intake.credits() == {"a": 10, "b": 1, "other": 1}
    assert intake.held == 10 and broker.consumers("q.client.a") == 10
    engine.cap = cap(free_blocks=0)  # no KV room: no lane gains credits
    b.publish(30)
    await settle_down()
    assert any(m.tag >= 60 for m, _ in running), "b's first request is delivered at once"
    await finish(4)  # a's: its credits take their places' new messages
    intake.capacity_changed()
    await settle_down()
    assert intake.credits()["b"] == 1 and intake.held == 10
    engine.cap = cap()
    for _ in range(5):  # nothing ends: b's growth waits for a's given-up credits
        intake.capacity_changed()
        await settle_down()
    # b asked for 4, a gave up 2 busy credits (their places come free as they end), no more
    assert intake.credits() == {"a": 7, "b": 2, "other": 1}, intake.credits()
    assert intake.held == 11
    for _ in range(30):  # requests end, in order; b's share grows as a's shrinks
        await finish(2)
        intake.capacity_changed()
        await settle_down()
    # weights 1:3 over the 11 credits not kept by `other`
    assert intake.credits() == {"a": 3, "b": 8, "other": 1}
    shown = {
        c: metrics.registry.get_sample_value(
            "kvflow_lane_credits", {"worker": "w", "model": "m", "client": c}
        )
        for c in ("a", "b", "other")
    }
    assert shown == {"a": 3, "b": 8, "other": 1}
    assert broker.most_unsettled <= 12, broker.most_unsettled
    assert a.messages, "a still has a backlog"

    drain.pause()  # every credit is cancelled; what is held stays until settled
    intake.capacity_changed()
    await settle_down()
    assert intake.credits() == {"a": 0, "b": 0, "other": 0}
    left = len(a.messages) + len(b.messages)
    await finish(len(running))
    assert intake.held == 0 and len(a.messages) + len(b.messages) == left
    acked = [tag for what, tag in events if what == "ack"]
    assert len(acked) == len(set(acked)) == 90 - left

    intake.stop()
    await asyncio.wait_for(run, 10)


@dataclass
class Burst:
    """A burst-mode intake on lane `a` whose requests are acked as soon as delivered."""

    events: list[Any]
    broker: Broker
    intake: LaneIntake
    drain: DrainState
    lane: FakeLane


async def burst_intake(upstream_drained: Any = None) -> Burst:
    events: list[Any] = []
    broker = Broker(events)

    async def deliver(message: Any, admitted: Any) -> None:
        await message.ack()

    intake, drain = lane_intake(
        broker, Lanes("q", {"a": 1.0}), 4, deliver, burst=True, upstream_drained=upstream_drained
    )
    lane = await broker.declare_queue("q.client.a", passive=True)
    return Burst(events, broker, intake, drain, lane)


def acked(events: list[Any]) -> list[int]:
    return sorted(tag for what, tag in events if what == "ack")


async def test_burst_mode_ends_once_every_lane_is_empty_and_all_is_settled() -> None:
    b = await burst_intake()
    b.lane.publish(9)
    await asyncio.wait_for(b.intake.run(), 10)
    assert acked(b.events) == list(range(9))
    assert b.broker.unsettled == 0 and b.broker.consumers("q.client.a") == 0


async def test_burst_mode_waits_for_what_is_still_upstream_of_the_lanes() -> None:
    """Fair mode's router may still hold requests on their way into the lanes, or have
    them in the request queue: burst mode ends only once it has none left either."""
    upstream = 5  # requests not routed yet: one is moved into lane a per look
    looks = 0

    async def drained() -> bool:
        nonlocal upstream, looks
        looks += 1
        if not upstream:
            return True
        upstream -= 1
        b.lane.publish(1)
        return False

    b = await burst_intake(upstream_drained=drained)
    b.lane.publish(9)
    await asyncio.wait_for(b.intake.run(), 10)
    assert acked(b.events) == list(range(14))
    assert upstream == 0 and looks >= 6
    assert b.broker.unsettled == 0 and b.broker.consumers("q.client.a") == 0


async def test_a_drained_burst_worker_takes_nothing_from_the_lanes() -> None:
    """Drained, burst mode does not look into the lanes: a message it took would only go
    back to its lane, a delivery count each time, until the broker dead-lettered it."""
    b = await burst_intake()
    intake, events = b.intake, b.events
    b.lane.publish(5)
    b.drain.pause()
    run = asyncio.create_task(intake.run())
    for _ in range(20):  # the intake's polls come and go; nothing is taken
        intake.capacity_changed()
        await settle_down()
    assert events == [] and not run.done()
    b.drain.resume()
    intake.capacity_changed()
    await asyncio.wait_for(run, 10)
    assert acked(events) == list(range(5))
    assert all(what == "ack" for what, _ in events)


@dataclass
class OneLane:
    """Lane `a` with 20 messages, consumed by a running intake whose requests end only
    once `release` is set."""

    events: list[Any]
    lane: FakeLane
    intake: LaneIntake
    drain: DrainState
    run: asyncio.Task[None]
    release: asyncio.Event


async def one_lane(max_held: int) -> OneLane:
    events: list[Any] = []
    broker = Broker(events)
    release = asyncio.Event()

    async def deliver(message: Any, admitted: Any) -> None:
        await release.wait()
        await message.ack()

    intake, drain = lane_intake(broker, Lanes("q", {"a": 1.0}), max_held, deliver)
    lane = await broker.declare_queue("q.client.a", passive=True)
    lane.publish(20)
    run = asyncio.create_task(intake.run())
    await settle_down(200)
    return OneLane(events, lane, intake, drain, run, release)


async def test_a_cancel_cut_by_a_closed_channel_leaves_no_dead_credit(caplog: Any) -> None:
    t = await one_lane(6)
    events, lane, intake, drain, release = t.events, t.lane, t.intake, t.drain, t.release
    assert intake.credits() == {"a": 5, "other": 1} and intake.held == 5

    async def closed(tag: str) -> None:
        lane.consumers.pop(tag, None)  # the consumer went with its channel
        raise ConnectionError("channel closed")

    lane.cancel = closed  # type: ignore[method-assign]
    drain.pause()
    intake.capacity_changed()
    await settle_down()
    # Every credit is out of the books at once, its message counted until settled.
    assert intake.credits() == {"a": 0, "other": 0}
    assert "not cancelled cleanly" in caplog.text
    release.set()
    await settle_down()
    assert intake.held == 0 and len(lane.messages) == 15
    drain.resume()  # credits come back, none of them dead: the lane is served to the end
    intake.capacity_changed()
    await settle_down(400)
    assert not lane.messages and intake.held == 0
    assert sorted(tag for what, tag in events if what == "ack") == list(range(20))
    intake.stop()
    await asyncio.wait_for(t.run, 10)


async def test_a_drain_gives_back_no_message_to_a_credit_still_being_cancelled() -> None:
    t = await one_lane(2)
    events, lane, intake, drain, release = t.events, t.lane, t.intake, t.drain, t.release
    assert intake.credits() == {"a": 1, "other": 1} and intake.held == 1
    gate = asyncio.Event()
    cancel = lane.cancel

    async def slow_cancel(tag: str) -> None:  # the broker has not answered yet
        await gate.wait()
        await cancel(tag)

    lane.cancel = slow_cancel  # type: ignore[method-assign]
    drain.pause()
    intake.capacity_changed()
    await settle_down()
    release.set()  # message 0 ends; the consumer, still there, is pushed message 1
    await settle_down()
    assert ("ack", 0) in events and not [e for e in events if e[0] == "requeue"]
    gate.set()  # the cancel is through: message 1 goes back, and nothing comes after it
    await settle_down()
    assert [e for e in events if e[0] == "requeue"] == [("requeue", 1)]
    assert len(lane.messages) == 18 and intake.held == 0
    intake.stop()
    await asyncio.wait_for(t.run, 10)
