"""Taking work: a message reaches the worker only when the engine can place it.

The intake consumes with a prefetch window of `max_num_seqs + lookahead`: the broker
never has more of this worker's messages unacked than that, and every message held
unsettled (running, waiting, being admitted, finishing, parked as a copy) counts. It
consumes only while the engine has KV room for the waiting prompts plus a reserve of
blocks (`FlowControl.has_room`); when room runs out the consumer is cancelled, and it
consumes again when room frees. So a worker never sits on a backlog another worker
could serve, a message needs no round trip of its own (a basic.get per message capped
a worker near 175 messages/s), and a delivered request joins the running batch at the
next step boundary.

The intake owns what is held: one task per message, from its delivery until it is settled.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from broker.messages.properties import delivery_count
from worker.engine.async_engine import EngineFront
from worker.engine.engine import Capacity
from worker.metrics import Metrics
from worker.serving.drain import DrainState
from worker.serving.settlement import Settlement

log = logging.getLogger(__name__)

Deliver = Callable[[AbstractIncomingMessage, Callable[[], None]], Awaitable[None]]


@dataclass(frozen=True)
class FlowControl:
    """How much a worker takes: a window of unsettled messages, and KV room."""

    max_held: int  # max_num_seqs + lookahead: the consumer's prefetch window
    reserve_blocks: int

    def has_room(self, cap: Capacity) -> bool:
        """KV room for the waiting prompts plus the reserve: keep consuming."""
        return cap.free_tokens >= self.reserve_blocks * cap.block_size


class Intake(abc.ABC):
    """Holds each message taken, from its delivery until it is settled, running
    `deliver(message, admitted)` for it; subclasses decide how messages are taken."""

    def __init__(
        self,
        engine: EngineFront,
        flow: FlowControl,
        drain: DrainState,
        settlement: Settlement,
        metrics: Metrics,
        deliver: Deliver,
        *,
        poll_max_s: float,
        burst: bool = False,
    ) -> None:
        self.engine = engine
        self.flow = flow
        self.drain = drain
        self.settlement = settlement
        self.metrics = metrics
        self.deliver = deliver
        self.poll_max_s = poll_max_s
        self.burst = burst
        self.pulled = 0
        self._held: set[asyncio.Task[None]] = set()
        self._capacity_changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._burst_pause = 0.002

    @property
    def held(self) -> int:
        """Messages pulled and not yet settled."""
        return len(self._held)

    def capacity_changed(self) -> None:
        """The engine's capacity may have grown (a step ended, a request left)."""
        self._capacity_changed.set()

    def stop(self) -> None:
        """End `run`: its consumer is cancelled (run is not: an RPC cancelled in flight
        makes the client close the channel, and with it the acks still to come)."""
        self._stopping.set()
        self._capacity_changed.set()

    @abc.abstractmethod
    async def run(self) -> None:
        """Take messages until stopped (burst mode: until the queue is empty and nothing
        is held)."""

    async def _delivered(
        self,
        message: AbstractIncomingMessage,
        on_settled: Callable[[], None] | None = None,
        on_admitted: Callable[[], None] | None = None,
    ) -> None:
        # A drain began while this delivery was on its way: give the message back,
        # unless the queue would then drop it (its last allowed delivery): that one is
        # served.
        draining = self.drain.paused or self._stopping.is_set()
        if draining and not self.settlement.last_delivery(delivery_count(message.headers)):
            try:
                await self.settlement.requeue(message, None)
            finally:  # a closed channel may cancel this mid-way: still counted as settled
                if on_settled is not None:
                    on_settled()
            return
        self.pulled += 1
        self._hold(message, on_settled, on_admitted)

    async def _wait_for_change(self, timeout_s: float = 0.5) -> None:
        """Until capacity may have changed, the worker is resumed, or it stops."""
        self._capacity_changed.clear()
        waits: list[Awaitable[object]] = [self._capacity_changed.wait(), self._stopping.wait()]
        if self.drain.paused:
            waits.append(self.drain.wait_resumed())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_first(*waits), timeout_s)

    async def _nothing_left(self, is_empty: Callable[[], Awaitable[bool]]) -> bool:
        """Burst mode with nothing held: True once `is_empty()` finds nothing left to
        take; else False after a pause that grows up to `poll_max_s`."""
        if await is_empty():
            return True
        await asyncio.sleep(self._burst_pause)
        self._burst_pause = min(self._burst_pause * 2, self.poll_max_s)
        return False

    async def wait_settled(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every held message to be settled; returns how many
        are still held."""
        if self._held:
            await asyncio.wait(set(self._held), timeout=timeout_s)
        return len(self._held)

    def _hold(
        self,
        message: AbstractIncomingMessage,
        on_settled: Callable[[], None] | None = None,
        on_admitted: Callable[[], None] | None = None,
    ) -> None:
        def admitted() -> None:  # the engine has the request: its capacity counts it now
            if on_admitted is not None:
                on_admitted()
            self._capacity_changed.set()

        async def run() -> None:
            try:
                await self.deliver(message, admitted)
            finally:
                if on_settled is not None:
                    on_settled()

        task = asyncio.create_task(run())
        self._held.add(task)
        task.add_done_callback(self._settled)
        self.metrics.unacked.set(self.held)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._held.discard(task)
        self._capacity_changed.set()
        self.metrics.unacked.set(self.held)
        if not task.cancelled() and task.exception() is not None:
            log.error("request task failed", exc_info=task.exception())


class QueueIntake(Intake):
    """Consumes one queue with the prefetch window, while the engine has KV room."""

    def __init__(self, queue: AbstractQueue, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = queue

    async def run(self) -> None:
        """Consume while resumed and the engine has room, until stopped; returns early
        in burst mode once the queue is empty and nothing is held."""
        tag: str | None = None
        try:
            while not self._stopping.is_set():
                want = not self.drain.paused and self.flow.has_room(self.engine.capacity())
                try:
                    if want and tag is None:
                        tag = await self.queue.consume(self._delivered, no_ack=False)
                    elif not want and tag is not None:
                        await self.queue.cancel(tag)
                        tag = None
                except Exception as e:  # a closed channel: the robust connection reopens
                    # it (and its consumers); the intake must outlive it
                    log.warning("consume or cancel failed (%r); retrying", e)
                    await asyncio.sleep(0.5)
                    continue
                if self.burst and tag is not None and not self._held:
                    if await self._nothing_left(self._queue_is_empty):
                        log.info("queue empty and nothing in flight: burst mode ends")
                        return
                    continue
                await self._wait_for_change()
        finally:
            if tag is not None:
                with contextlib.suppress(Exception):
                    await self.queue.cancel(tag)

    async def _queue_is_empty(self) -> bool:
        """Burst mode: nothing left to take (a basic.get; what it finds is held)."""
        try:
            message = await self.queue.get(no_ack=False, fail=False, timeout=10)
        except Exception as e:
            log.warning("pull failed (%r); retrying", e)
            return False
        if message is None:
            return True
        await self._delivered(message)
        return False


async def _first(*waits: Awaitable[object]) -> None:
    """Wait until the first of several awaitables is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
