"""Pulling work: a message is taken from the queue only when the engine can place it.

Flow control (`FlowControl.can_pull`): a free sequence slot, counting every message held
unsettled (running, waiting, being admitted, finishing, parked as a copy) against
`max_num_seqs + lookahead`, and KV room for the waiting prompts plus a reserve of blocks.
So a worker never sits on a backlog another worker could serve, and a pulled request
joins the running batch at the next step boundary.

The intake owns what is held: one task per message, from the pull until it is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
    """When one more message may be pulled."""

    max_held: int  # max_num_seqs + lookahead
    reserve_blocks: int

    def can_pull(self, cap: Capacity, held: int, admitting: int) -> bool:
        # A finished request's message stays unacked until its ledger row commits and
        # its reply is confirmed: count messages held, not only requests in the engine.
        if max(cap.running + cap.waiting + admitting, held) >= self.max_held:
            return False
        return cap.free_tokens >= self.reserve_blocks * cap.block_size


class Intake:
    """Pulls messages by capacity and runs `deliver(message, admitted)` for each."""

    def __init__(
        self,
        queue: AbstractQueue,
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
        self.queue = queue
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
        self._admitting = 0
        self._capacity_changed = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def held(self) -> int:
        """Messages pulled and not yet settled."""
        return len(self._held)

    def capacity_changed(self) -> None:
        """The engine's capacity may have grown (a step ended, a request left)."""
        self._capacity_changed.set()

    def stop(self) -> None:
        """End `run` after the pull in flight (not cancelled: a basic.get cancelled in
        flight makes the client close the channel, and with it the acks still to come)."""
        self._stopping.set()
        self._capacity_changed.set()

    async def run(self) -> None:
        """Pull until stopped; returns early in burst mode once the queue is empty and
        nothing is held."""
        pause = 0.002
        while not self._stopping.is_set():
            if self.drain.paused:
                await _first(self.drain.wait_resumed(), self._stopping.wait())
                continue
            if not self.flow.can_pull(self.engine.capacity(), self.held, self._admitting):
                self._capacity_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity_changed.wait(), 0.5)
                continue
            try:
                message = await self.queue.get(no_ack=False, fail=False, timeout=10)
            except Exception as e:  # a closed channel, a timed-out get: the robust
                # connection reopens the channel; the intake must outlive it
                log.warning("pull failed (%r); retrying", e)
                await asyncio.sleep(0.5)
                continue
            if message is None:
                if self.burst and not self._held:
                    log.info("queue empty and nothing in flight: burst mode ends")
                    return
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.poll_max_s)
                continue
            pause = 0.002
            # A drain began while this pull was in flight: give the message back, unless
            # the queue would then drop it (its last allowed delivery): that one is served.
            draining = self.drain.paused or self._stopping.is_set()
            if draining and not self.settlement.last_delivery(delivery_count(message.headers)):
                await self.settlement.requeue(message, None)
                continue
            self.pulled += 1
            self._hold(message)

    async def wait_settled(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every held message to be settled; returns how many
        are still held."""
        if self._held:
            await asyncio.wait(set(self._held), timeout=timeout_s)
        return len(self._held)

    def _hold(self, message: AbstractIncomingMessage) -> None:
        # The request counts as "being admitted" until the engine has it (or it ended
        # without running): only then does the engine's capacity figure include it.
        self._admitting += 1
        pending = True

        def admitted() -> None:
            nonlocal pending
            if pending:
                pending = False
                self._admitting -= 1
                self._capacity_changed.set()

        async def run() -> None:
            try:
                await self.deliver(message, admitted)
            finally:
                admitted()

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


async def _first(*waits: Awaitable[object]) -> None:
    """Wait until the first of several awaitables is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
