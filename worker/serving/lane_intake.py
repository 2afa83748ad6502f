"""Fair mode's intake: consumes the clients' lanes, each with as many credits as it is given.

A credit is a consumer on a lane with a window of one message (the channel's per-consumer
prefetch is 1): the broker pushes it a message, and the next only once that one is
acked. So a lane with k credits has at most k of its messages in this worker (waiting,
running or being settled), and the credits of all lanes, plus the messages of credits
being given back, never exceed the worker's window (`FlowControl.max_held`): the worker
holds what it can place, as with one queue, yet no message needs a round trip of its
own. How many credits each lane gets is `Lanes.share`'s decision (the policy); this
module only adds consumers to a lane and cancels them (the mechanism), at step
boundaries and deliveries. A cancelled credit that holds a message keeps it until it is
settled; its place in the window is given to another lane only then. Without KV room
for the waiting prompts no lane gains credits (messages come only in place of requests
that left); a drain cancels every credit. Burst mode ends once every lane is empty,
nothing is held, and what feeds the lanes (the router: the request queue and the
messages on their way from it) is empty too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from worker.serving.intake import Intake
from worker.serving.lanes import Lane, Lanes

log = logging.getLogger(__name__)


@dataclass(eq=False)  # each credit is itself (hashed by identity)
class Credit:
    """One consumer of a lane, window of one message."""

    tag: str
    lane: Lane
    held: int = 0  # its messages not yet settled (one; two across a reconnect)
    cancelled: bool = False
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # its cancel has ended


class LaneIntake(Intake):
    """Consumes the lanes of `lanes` on `channel` (opened with per-consumer prefetch 1),
    with the credits `lanes.share` gives each."""

    def __init__(
        self,
        channel: AbstractChannel,
        lanes: Lanes,
        *args: Any,
        clock: Callable[[], float] = time.monotonic,
        upstream_drained: Callable[[], Awaitable[bool]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.lanes = lanes
        self.clock = clock
        self.upstream_drained = upstream_drained  # burst mode: nothing left to feed the lanes
        self._queues: dict[str, AbstractQueue] = {}
        self._active: dict[str, list[Credit]] = {c: [] for c in lanes.lanes}
        self._leaving: set[Credit] = set()  # cancelled, still holding a message
        self._tags = (f"kvflow.{uuid.uuid4().hex[:8]}.{n}" for n in itertools.count())

    def credits(self) -> dict[str, int]:
        """Credits per lane now (cancelled ones not counted)."""
        return {c: len(credits) for c, credits in self._active.items()}

    async def run(self) -> None:
        try:
            for lane in self.lanes.lanes.values():
                # Declared (passively), not merely named: a robust channel restores the
                # consumers of the queues it declared after a reconnect, and only those.
                self._queues[lane.client] = await self.channel.declare_queue(
                    lane.queue, passive=True
                )
            while not self._stopping.is_set():
                try:
                    await self._reconcile()
                except Exception as e:  # a closed channel: the robust connection reopens
                    # it (and its consumers); the intake must outlive it
                    log.warning("consume or cancel on a lane failed (%r); retrying", e)
                    await asyncio.sleep(0.5)
                    continue
                # Not while drained: a lane's message taken then would only go back,
                # spending a delivery count each time.
                if self.burst and not self._held and not self.drain.paused:
                    if await self._nothing_left(self._lanes_are_empty):
                        log.info("every lane empty and nothing in flight: burst mode ends")
                        return
                    continue
                await self._wait_for_change()
        finally:
            with contextlib.suppress(Exception):
                await self._channel_ready()
                await self._cancel_all([k for credits in self._active.values() for k in credits])

    def targets(self) -> dict[str, int]:
        """Credits each lane should have now (the policy's answer, within the window)."""
        have = self.credits()
        if self.drain.paused or self._stopping.is_set():
            return {c: 0 for c in have}
        used = {c: sum(1 for k in credits if k.held) for c, credits in self._active.items()}
        # The whole window is shared: a cancelled credit's message is the place of the
        # credit its lane gave up, counted (by `_room_for_credit`) until it is settled.
        want = self.lanes.share(self.flow.max_held, have, used, self.clock())
        if not self.flow.has_room(self.engine.capacity()):
            want = {c: min(n, have[c]) for c, n in want.items()}  # no lane gains
        return want

    async def _reconcile(self) -> None:
        """Cancel credits of lanes over their target (idle ones first), then add credits
        to lanes under it, as far as the window allows."""
        await self._channel_ready()
        want = self.targets()
        over: list[Credit] = []
        for client, credits in self._active.items():
            extra = len(credits) - want[client]
            if extra > 0:
                over += sorted(credits, key=lambda k: k.held)[:extra]
        await self._cancel_all(over)
        added = False
        for client, credits in self._active.items():
            while len(credits) < want[client] and self._room_for_credit():
                await self._add(self.lanes.lanes[client])
                added = True
        if over or added:
            for client, n in self.credits().items():
                self.metrics.set_lane_credits(client, n)

    def _room_for_credit(self) -> bool:
        active = sum(len(credits) for credits in self._active.values())
        return active + sum(k.held for k in self._leaving) < self.flow.max_held

    async def _add(self, lane: Lane) -> None:
        credit = Credit(next(self._tags), lane)
        self._active[lane.client].append(credit)  # before the first delivery can come
        try:
            await self._queues[lane.client].consume(
                functools.partial(self._on_message, credit), no_ack=False, consumer_tag=credit.tag
            )
        except BaseException:
            # Not confirmed: if the broker did register it, what it delivers counts as
            # a leaving credit's (and the consumer goes with its channel).
            self._active[lane.client].remove(credit)
            credit.cancelled = True
            credit.gone.set()
            raise

    async def _cancel_all(self, credits: list[Credit]) -> None:
        """Cancel `credits` together (one round trip for all: during a drain, a credit
        still consuming takes a message only to give it back)."""
        for credit in credits:
            # Out of the books first: a cancel cut by a closed channel still ends the
            # consumer (it goes with the channel; a robust channel does not restore a
            # consumer it was asked to cancel).
            self._active[credit.lane.client].remove(credit)
            credit.cancelled = True
            if credit.held:
                self._leaving.add(credit)
        done = await asyncio.gather(
            *(self._queues[k.lane.client].cancel(k.tag) for k in credits), return_exceptions=True
        )
        for credit in credits:
            credit.gone.set()
        failed = [e for e in done if isinstance(e, Exception)]
        if failed:
            log.warning(
                "%d of %d lane credits not cancelled cleanly (%r)",
                len(failed),
                len(done),
                failed[0],
            )

    async def _channel_ready(self) -> None:
        """After a reconnect, wait until the robust channel has restored its consumers:
        a cancel sent before that would be undone by the restore."""
        ready = getattr(self.channel, "ready", None)  # robust channels only
        if ready is not None:
            await ready()

    async def _on_message(self, credit: Credit, message: AbstractIncomingMessage) -> None:
        credit.held += 1
        if credit.cancelled:
            self._leaving.add(credit)  # delivered as it was being cancelled
            # Until the broker has the cancel, a message given back (a drain) would come
            # straight back to this consumer, spending a delivery count each time.
            await credit.gone.wait()

        def settled() -> None:
            credit.held -= 1
            if credit.held == 0:
                self._leaving.discard(credit)

        await self._delivered(message, settled)
        self._capacity_changed.set()  # a lane whose credits are all in use may get more

    async def _lanes_are_empty(self) -> bool:
        """Burst mode: nothing left upstream of the lanes, then nothing left in any lane
        (a basic.get each; what one finds is held, outside the credits). Upstream first:
        a message on its way into a lane during the lanes' looks is counted there."""
        if self.upstream_drained is not None:
            try:
                if not await self.upstream_drained():
                    return False
            except Exception as e:
                log.warning("look into the request queue failed (%r); retrying", e)
                return False
        for queue in self._queues.values():
            try:
                message = await queue.get(no_ack=False, fail=False, timeout=10)
            except Exception as e:
                log.warning("look into a lane failed (%r); retrying", e)
                return False
            if message is not None:
                await self._delivered(message)
                return False
        return True
