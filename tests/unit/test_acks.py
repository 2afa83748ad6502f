"""broker.acks: acks in runs per channel, never past a delivery that is not settled."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from broker.acks import Acker, ChannelAcks


@dataclass(eq=False)
class FakeChannel:
    """Records the ack frames written to it, in order (with nacks and rejects)."""

    frames: list[tuple[str, int, bool]] = field(default_factory=list)
    is_closed: bool = False

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        if self.is_closed:
            raise RuntimeError("closed")
        self.frames.append(("ack", delivery_tag, multiple))


@dataclass
class FakeDelivery:
    channel: FakeChannel
    delivery_tag: int

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self.channel.frames.append(("nack" if requeue else "drop", self.delivery_tag, False))

    async def reject(self, requeue: bool = False) -> None:
        self.channel.frames.append(("reject", self.delivery_tag, False))


def acked(frames: list[tuple[str, int, bool]]) -> set[int]:
    """The tags the broker would count acked from `frames` (multiple: every tag below
    that is still outstanding)."""
    done: set[int] = set()
    for what, tag, multiple in frames:
        if what == "ack" and multiple:
            done |= set(range(1, tag + 1))
        elif what == "ack":
            done.add(tag)
    return done


async def test_in_order_acks_of_one_turn_are_one_multiple_frame() -> None:
    ch = FakeChannel()
    acker = Acker()
    for tag in range(1, 11):
        await acker.ack(FakeDelivery(ch, tag))
    await acker.flush()
    assert ch.frames == [("ack", 10, True)]


async def test_an_ack_above_an_unsettled_delivery_goes_alone_and_the_prefix_waits() -> None:
    ch = FakeChannel()
    acker = Acker()
    for tag in (1, 2, 4, 5):  # 3 still runs
        await acker.ack(FakeDelivery(ch, tag))
    await acker.flush()
    assert ch.frames == [("ack", 2, True), ("ack", 4, False), ("ack", 5, False)]
    assert 3 not in acked(ch.frames)
    ch.frames.clear()
    for tag in (6, 3, 7):
        await acker.ack(FakeDelivery(ch, tag))
    await acker.flush()
    # 3 closes the gap: 1..7 are all settled, one frame covers the new ones
    assert ch.frames == [("ack", 7, True)]


async def test_a_multiple_ack_never_covers_a_delivery_not_yet_settled() -> None:
    ch = FakeChannel()
    acker = Acker()
    order = [5, 1, 9, 2, 3, 8, 7, 4, 6, 10]
    settled: set[int] = set()
    for tag in order:
        await acker.ack(FakeDelivery(ch, tag))
        settled.add(tag)
        await acker.flush()
        assert acked(ch.frames) <= settled
    assert acked(ch.frames) == set(range(1, 11))


async def test_nacks_and_rejects_go_at_once_and_count_toward_the_prefix() -> None:
    ch = FakeChannel()
    acker = Acker()
    await acker.ack(FakeDelivery(ch, 1))
    await acker.nack(FakeDelivery(ch, 2), requeue=True)
    await acker.reject(FakeDelivery(ch, 3), requeue=False)
    await acker.ack(FakeDelivery(ch, 4))
    await acker.flush()
    # the nack and reject were written before the ack that passes their tags
    assert ch.frames == [("nack", 2, False), ("reject", 3, False), ("ack", 4, True)]


async def test_a_prefix_ending_in_a_nack_acks_up_to_its_last_ack() -> None:
    ch = FakeChannel()
    acker = Acker()
    await acker.ack(FakeDelivery(ch, 1))
    await acker.nack(FakeDelivery(ch, 2), requeue=True)
    await acker.flush()
    # the multiple ack names a tag that is outstanding (1), not the nacked one
    assert ch.frames == [("nack", 2, False), ("ack", 1, True)]


async def test_channels_are_tracked_apart_and_a_reopened_channel_starts_again() -> None:
    old, new = FakeChannel(), FakeChannel()
    acker = Acker()
    await acker.ack(FakeDelivery(old, 1))
    await acker.ack(FakeDelivery(old, 3))  # 2 still runs on the old channel
    await acker.flush()
    assert old.frames == [("ack", 1, True), ("ack", 3, False)]
    old.is_closed = True  # the connection dropped; tags start again at 1 on the new one
    await acker.ack(FakeDelivery(old, 2))  # too late: the broker redelivers it
    for tag in (1, 2):
        await acker.ack(FakeDelivery(new, tag))
    await acker.flush()
    assert new.frames == [("ack", 2, True)]
    assert old.frames == [("ack", 1, True), ("ack", 3, False)]


async def test_acks_to_a_closed_channel_are_reported_not_raised() -> None:
    ch = FakeChannel(is_closed=True)
    errors: list[int] = []
    acker = Acker(on_error=lambda n, e: errors.append(n))
    await acker.ack(FakeDelivery(ch, 1))
    await acker.flush()
    assert errors == [1] and ch.frames == []


async def test_acks_of_one_turn_leave_after_it_without_a_flush_call() -> None:
    ch = FakeChannel()
    acker = Acker()

    async def ack_all() -> None:
        for tag in range(1, 6):
            await acker.ack(FakeDelivery(ch, tag))

    await ack_all()
    assert ch.frames == []  # nothing written in the turn that acked
    while not ch.frames:
        await asyncio.sleep(0)
    assert ch.frames == [("ack", 5, True)]


def test_tracking_stops_past_a_gap_that_never_closes() -> None:
    state = ChannelAcks()
    for tag in range(2, 5):
        state.settle(tag, ack=True)
    assert state.take() == [(2, False), (3, False), (4, False)]
    state.tracking = False  # as after MAX_TRACKED settled tags above the gap
    state.settle(1, ack=True)
    state.settle(5, ack=True)
    assert state.take() == [(1, False), (5, False)]
    assert not state.settled
