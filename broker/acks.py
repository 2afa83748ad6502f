"""Acknowledging deliveries in runs: one `basic.ack` with `multiple=True` for many.

A worker settles its deliveries out of order (a short request ends before a long one
taken earlier), and an ack per message is a frame per message for the worker to write
and the broker to read. RabbitMQ's `multiple=True` acks every outstanding delivery of a
channel up to a tag, so it may be used only up to the highest tag below which every
delivery of that channel is settled. `Acker` keeps, per channel instance (delivery tags
are counted per channel from 1 and start again on a reopened channel), the tags settled
so far. The acks asked for in one event-loop turn leave together soon after it: the
settled prefix as one multiple ack, each ack above a gap (a delivery still running, or
one never handed to us) alone, at once: an ack is never held back waiting for another
delivery, so the prefetch window it frees is free as soon as before. A nack or reject
has its own effect and is sent at once; it counts toward the prefix once it is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Past this many settled tags above a gap that never closes (a delivery lost with its
# consumer), a channel's acks go one by one: the prefix is not tracked further.
MAX_TRACKED = 100_000


class AckChannel(Protocol):
    """What `Acker` needs of a channel (aiormq's)."""

    @property
    def is_closed(self) -> bool: ...

    async def basic_ack(self, delivery_tag: int, multiple: bool = ..., wait: bool = ...) -> None:
        """Send basic.ack."""


class Delivered(Protocol):
    """What `Acker` needs of a delivered message (aio-pika's `IncomingMessage`)."""

    @property
    def channel(self) -> Any: ...

    @property
    def delivery_tag(self) -> int | None: ...

    async def nack(self, multiple: bool = ..., requeue: bool = ...) -> None: ...

    async def reject(self, requeue: bool = ...) -> None: ...


@dataclass
class ChannelAcks:
    """The settled tags of one channel instance, and the acks not yet sent."""

    floor: int = 0  # every tag <= floor is settled and its ack (if any) sent
    settled: set[int] = field(default_factory=set)  # settled tags above the floor
    pending: set[int] = field(default_factory=set)  # of those, acks not yet sent
    tracking: bool = True  # False: a gap never closed; acks go one by one

    def settle(self, tag: int, *, ack: bool) -> None:
        """Tag `tag` is settled (`ack`: by an ack still to send)."""
        if tag <= self.floor or tag in self.settled:
            return
        self.settled.add(tag)
        if ack:
            self.pending.add(tag)

    def take(self) -> list[tuple[int, bool]]:
        """The ack frames to send now, as (delivery tag, multiple), in order; the tags
        they cover are then sent."""
        frames: list[tuple[int, bool]] = []
        if not self.pending:
            return frames
        top = 0  # the highest tag in the advanced prefix with an ack to send
        if self.tracking:
            while self.floor + 1 in self.settled:
                self.floor += 1
                self.settled.discard(self.floor)
                if self.floor in self.pending:
                    self.pending.discard(self.floor)
                    top = self.floor
        if top:
            frames.append((top, True))
        # Above a gap: alone, now (never held back for a delivery that may run long).
        frames.extend((tag, False) for tag in sorted(self.pending))
        self.pending.clear()
        if len(self.settled) > MAX_TRACKED:
            self.tracking = False
        if not self.tracking:
            self.settled.clear()
        return frames


class Acks(Protocol):
    """How deliveries are settled with the broker."""

    async def ack(self, message: Any) -> None: ...

    async def nack(self, message: Any, *, requeue: bool) -> None: ...

    async def reject(self, message: Any, *, requeue: bool) -> None: ...


class DirectAcks:
    """One frame per settlement, each sent before it returns (no runs)."""

    async def ack(self, message: Any) -> None:
        await message.ack()

    async def nack(self, message: Any, *, requeue: bool) -> None:
        await message.nack(requeue=requeue)

    async def reject(self, message: Any, *, requeue: bool) -> None:
        await message.reject(requeue=requeue)


class Acker:
    """Acks deliveries in runs per channel; nacks and rejects pass through, counted.

    `ack()` returns at once: the frame is written soon after the current event-loop
    turn, with the others of that turn. `on_error(count, error)` is told of acks that
    could not be sent (the channel closed first: the broker redelivers those messages).
    """

    def __init__(self, on_error: Callable[[int, BaseException], None] | None = None) -> None:
        self._channels: dict[Any, ChannelAcks] = {}
        self._flushing: asyncio.Task[None] | None = None
        self._on_error = on_error
        self.frames_sent = 0  # ack frames written (for tests and benchmarks)

    async def ack(self, message: Delivered) -> None:
        """Ack `message` with the others of this turn (returns at once)."""
        tag = message.delivery_tag
        if tag is None:
            return
        self._state(message.channel).settle(tag, ack=True)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def nack(self, message: Delivered, *, requeue: bool) -> None:
        """Nack `message` now (raises what the client raises)."""
        await message.nack(requeue=requeue)
        self._settled(message)

    async def reject(self, message: Delivered, *, requeue: bool) -> None:
        """Reject `message` now (raises what the client raises)."""
        await message.reject(requeue=requeue)
        self._settled(message)

    async def flush(self) -> None:
        """Send what is pending now (what `ack()` schedules on its own)."""
        await self._flush()

    def _settled(self, message: Delivered) -> None:
        tag = message.delivery_tag
        if tag is not None:
            self._state(message.channel).settle(tag, ack=False)

    def _state(self, channel: Any) -> ChannelAcks:
        state = self._channels.get(channel)
        if state is None:
            state = self._channels[channel] = ChannelAcks()
        return state

    async def _flush(self) -> None:
        try:
            for channel, state in list(self._channels.items()):
                frames = state.take()
                if channel.is_closed:
                    del self._channels[channel]
                    if frames:
                        self._failed(len(frames), RuntimeError("the channel is closed"))
                    continue
                for i, (tag, multiple) in enumerate(frames):
                    try:
                        # wait=False: queued for the connection's writer, no drain wait
                        await channel.basic_ack(tag, multiple=multiple, wait=False)
                    except Exception as e:
                        self._failed(len(frames) - i, e)
                        break
                    self.frames_sent += 1
        finally:
            self._flushing = None
            if any(state.pending for state in self._channels.values()):
                # acked while this flush waited for room in the writer's queue
                self._flushing = asyncio.get_running_loop().create_task(self._flush())

    def _failed(self, frames: int, error: BaseException) -> None:
        log.warning(
            "could not send %d ack frame(s) (%r); the broker redelivers those messages and "
            "the ledger answers them",
            frames,
            error,
        )
        if self._on_error is not None:
            self._on_error(frames, error)
