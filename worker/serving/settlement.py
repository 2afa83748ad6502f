"""Settling deliveries: the ledger commit, then the final reply, then the ack (or a requeue or a dead-letter).

The order is the delivery guarantee: a message is acked only after its final ledger row
is committed and its final reply is confirmed by the broker. A worker that dies before
that leaves the message unacked and RabbitMQ redelivers it; the ledger (one row per id)
makes the rerun land exactly once.

Settlement also owns the copies of a request that arrive while it is being served here
(a redelivery after a reconnect, a producer's retry): the first delivery of an id
`claim`s it and the others `park` behind it. Parked copies are settled with the first:
each is answered with the same final outcome (the ledger's) at its own reply address,
and acked, or given back to the queue if the first ends without an outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from aio_pika.abc import AbstractIncomingMessage

from broker.acks import Acks, DirectAcks
from broker.messages import CRASHES_HEADER
from broker.publisher import Requeuer
from worker.ledger import LedgerStore, RequestRecord
from worker.ledger.records import OUTCOME
from worker.metrics import MessageEvent, Metrics
from worker.outcome import Outcome, crashed_alone_text, returned_text
from worker.records import Origin, error_record
from worker.serving.drain import GiveBack
from worker.serving.replies import Address, Replier, error_body, from_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Return:
    """A delivery going back to the queue, and what is needed to end it here instead."""

    why: GiveBack
    request_id: str | None
    delivery_count: int | None = None
    crashes: int = 0
    to: Address | None = None  # None: not decoded (it cannot be answered or recorded)
    origin: Origin | None = None


@dataclass
class _Flight:
    """The deliveries of one id being served here: the first and the copies parked behind it."""

    copies: list[tuple[AbstractIncomingMessage, Address]] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class Settlement:
    """Commits, answers and acknowledges; one per worker."""

    def __init__(
        self,
        ledger: LedgerStore,
        replier: Replier,
        metrics: Metrics,
        *,
        delivery_limit: int,
        requeuer: Requeuer | None = None,
        acks: Acks | None = None,
    ) -> None:
        self.ledger = ledger
        self.acks: Acks = acks if acks is not None else DirectAcks()
        self.replier = replier
        self.metrics = metrics
        self.delivery_limit = delivery_limit
        self.requeuer = requeuer
        self._flights: dict[str, _Flight] = {}

    # -- copies of one id --------------------------------------------------------------------

    def claim(self, request_id: str) -> bool:
        """True if no delivery of `request_id` is being served here: this one serves it."""
        if request_id in self._flights:
            return False
        self._flights[request_id] = _Flight()
        return True

    async def park(self, request_id: str, message: AbstractIncomingMessage, to: Address) -> None:
        """Hold a copy until the first delivery of its id is settled (it settles this one too)."""
        flight = self._flights.get(request_id)
        if flight is None:  # the first was settled in between: the copy is redelivered
            await self.requeue(message, request_id)
            return
        flight.copies.append((message, to))
        await flight.settled.wait()

    async def release(self, request_id: str) -> None:
        """The first delivery of `request_id` is done: copies it did not settle go back to
        the queue (a redelivery is answered from the ledger, or runs if nothing was recorded)."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        for message, _ in flight.copies:
            with contextlib.suppress(Exception):
                await self.acks.nack(message, requeue=True)
                self.metrics.on_message(MessageEvent.REQUEUED)
        flight.copies.clear()
        flight.settled.set()

    # -- the ends of a delivery --------------------------------------------------------------

    async def conclude(
        self, message: AbstractIncomingMessage, to: Address, record: RequestRecord, body: bytes
    ) -> None:
        """Commit the final `record`, send the final reply, ack: a run's end, or an end
        without a run (expired, cancelled). `body` is the reply built from `record`; if
        the ledger keeps another delivery's outcome, that one is sent instead."""
        stored = await self.ledger.record(record)
        self.metrics.on_recorded(record.client, record.status)
        body = self._ledger_answer(to, record, stored, body)
        await self._answer(to, body)
        await self._ack(message, to, body)

    async def replay(
        self, message: AbstractIncomingMessage, to: Address, stored: RequestRecord
    ) -> None:
        """A delivery of a request that already ended: resend its outcome, run nothing."""
        body = from_record(to.request_id, stored)
        await self._answer(to, body)
        await self._ack(message, to, body)
        self.metrics.on_message(MessageEvent.REPLAYED)

    async def reject(
        self, message: AbstractIncomingMessage, to: Address, record: RequestRecord, body: bytes
    ) -> None:
        """Bad input: a 'rejected' row (unless the id already has one: a malformed copy
        never ends a valid request's row), an error reply (the ledger's outcome if the id
        already ended), and the message to the dead-letter queue."""
        log.info("rejected %s: %s", to.request_id, record.error)
        try:
            stored: RequestRecord | None = await self.ledger.record_if_new(record)
        except Exception as e:  # the dead-letter queue still keeps the message
            log.error("rejected %s without a ledger row: %s", to.request_id, e)
            stored = None
        self.metrics.on_recorded(record.client, record.status)
        if stored is not None and stored.terminal:
            body = self._ledger_answer(to, record, stored, body)
        await self._answer(to, body)
        await self.acks.reject(message, requeue=False)
        self.metrics.on_message(MessageEvent.REJECTED)
        await self._settle_copies(to, body)

    async def dead_letter(
        self, message: AbstractIncomingMessage, to: Address, record: RequestRecord, body: bytes
    ) -> None:
        """A request that failed on its last allowed delivery: recorded, answered, and
        dead-lettered (it is not retried again)."""
        try:
            stored = await self.ledger.record(record)
            self.metrics.on_recorded(record.client, record.status)
            body = self._ledger_answer(to, record, stored, body)
            await self._answer(to, body)
            await self._settle_copies(to, body)
        finally:
            await self.acks.reject(message, requeue=False)
            self.metrics.on_message(MessageEvent.REJECTED)

    def last_delivery(self, delivery_count: int | None) -> bool:
        """This delivery is the last the queue allows: returned once more, the broker
        would dead-letter it on its own, whatever the ledger says."""
        return (delivery_count or 0) >= self.delivery_limit

    async def give_back(self, message: AbstractIncomingMessage, back: Return) -> None:
        """Return a delivery to the queue, or end it here when it must not go back.

        A drain (or an error of this worker) is a broker requeue, which counts toward
        the delivery limit: on the last allowed delivery the request ends `failed`
        instead, so the broker never drops a request the ledger thinks is running. A
        request the dead engine was running alone ends `failed` (it is the cause);
        requests it ran with others, or had not started, go back as new messages (not
        charged), the former marked as crash suspects (they will run alone).
        """
        if back.why is GiveBack.CRASHED_ALONE and back.to is not None:
            await self._fail(message, back, crashed_alone_text(back.crashes + 1))
            return
        if back.why in (GiveBack.CRASHED, GiveBack.ENGINE_DOWN) and self.requeuer is not None:
            crashes = back.crashes + (back.why is GiveBack.CRASHED)
            try:
                await self.requeuer.republish(message, {CRASHES_HEADER: crashes} if crashes else {})
            except Exception as e:
                log.warning("could not put %s back as a new message (%r)", back.request_id, e)
            else:
                await self._ack_one(message, back.request_id or "?")
                await self._requeue_copies(back.request_id)
                return
        if self.last_delivery(back.delivery_count) and back.to is not None:
            await self._fail(message, back, returned_text((back.delivery_count or 0) + 1))
            return
        await self.requeue(message, back.request_id)

    async def requeue(self, message: AbstractIncomingMessage, request_id: str | None) -> None:
        """A broker requeue of the delivery and the copies parked behind it: never
        dead-lettered by us (the ledger row stays 'running' until the next delivery)."""
        await self._nack(message, request_id)
        await self._requeue_copies(request_id)

    async def _fail(self, message: AbstractIncomingMessage, back: Return, text: str) -> None:
        assert back.to is not None and back.origin is not None
        log.error("request %s failed: %s", back.request_id, text)
        outcome = Outcome.internal(text)
        record = error_record(back.to.request_id, outcome, back.origin)
        await self.dead_letter(message, back.to, record, error_body(back.to.request_id, outcome))

    async def _requeue_copies(self, request_id: str | None) -> None:
        flight = self._flights.get(request_id) if request_id is not None else None
        if flight is None:
            return
        copies, flight.copies = flight.copies, []
        for m, _ in copies:
            await self._nack(m, request_id)

    async def _nack(self, message: AbstractIncomingMessage, request_id: str | None) -> None:
        try:
            await self.acks.nack(message, requeue=True)
            self.metrics.on_message(MessageEvent.REQUEUED)
        except Exception as e:
            log.warning(
                "could not requeue %s (%r); the broker requeues it when the channel closes",
                request_id,
                e,
            )

    # -- internals ---------------------------------------------------------------------------

    def _ledger_answer(
        self, to: Address, mine: RequestRecord, stored: RequestRecord | None, body: bytes
    ) -> bytes:
        """The final reply is what the ledger keeps: ours, unless another delivery's
        outcome committed first (two workers ran the request after a redelivery)."""
        if stored is None or _same_outcome(stored, mine):
            return body
        log.warning(
            "request %s: another delivery's outcome (%s by %s) was recorded first; replying with it",
            to.request_id,
            stored.status,
            stored.worker_id,
        )
        return from_record(to.request_id, stored)

    async def _answer(self, to: Address, body: bytes) -> None:
        await self.replier.send(to, body)

    async def _ack(self, message: AbstractIncomingMessage, to: Address, body: bytes) -> None:
        await self._settle_copies(to, body)
        await self._ack_one(message, to.request_id)

    async def _settle_copies(self, first: Address, body: bytes) -> None:
        """Answer and ack the copies parked behind `first` (each at its own address,
        once per address)."""
        flight = self._flights.get(first.request_id)
        if flight is None:
            return
        answered = {(first.reply_to, first.correlation_id)}
        copies, flight.copies = flight.copies, []
        for message, to in copies:
            if to.wanted and (to.reply_to, to.correlation_id) not in answered:
                answered.add((to.reply_to, to.correlation_id))
                with contextlib.suppress(Exception):
                    await self._answer(to, body)
            await self._ack_one(message, to.request_id)

    async def _ack_one(self, message: AbstractIncomingMessage, request_id: str) -> None:
        try:
            await self.acks.ack(message)
            self.metrics.on_message(MessageEvent.ACKED)
        except Exception as e:  # channel gone: the broker redelivers, the ledger answers
            log.warning(
                "could not ack %s (%r); a redelivery will be answered from the ledger",
                request_id,
                e,
            )


def _same_outcome(a: RequestRecord, b: RequestRecord) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in OUTCOME)
