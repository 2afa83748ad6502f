"""The dead-letter queue `<queue>.dead`: look without losing, replay, purge.

- `peek` takes up to `limit` messages with basic.get *without* ack and gives every one
  back (nack, requeue) when done; if the CLI dies in between, the broker requeues them
  when its channel closes. Nothing is lost and nothing is reordered for good.
- `replay` republishes dead letters to the request exchange with their original body
  and properties (the dead-lettering headers `x-death`, `x-first-death-*`,
  `x-last-death-*` and the quorum queue's `x-delivery-count` are dropped, so the
  request starts afresh), waits for the broker's publisher confirm, and only then acks
  the dead letter. Before republishing, the request's ledger row is reopened from
  rejected/failed to `queued` (error cleared, `LedgerStore.reopen_for_replay`):
  otherwise the worker would find a terminal row and answer from the ledger instead of
  running it. Fix the cause first
  (e.g. restart the workers with a higher `--max-tokens-cap`), or the replayed message
  is refused and dead-lettered again. `replay` takes at most the number of messages the
  queue held when it started, so a message that dies again is not replayed twice.
- `purge` drops them all.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage, AbstractQueue
from tqdm import tqdm

from broker.topology import Topology
from worker.admin.common import AdminError
from worker.admin.ledger_queries import LedgerReader
from worker.ledger.store import LedgerStore

_DROPPED_HEADERS = ("x-death", "x-first-death-", "x-last-death-", "x-delivery-count")


@dataclass(frozen=True)
class DeadLetter:
    """One dead-lettered message as `kvflow dlq list` shows it."""

    id: str | None
    size: int
    reason: str | None  # why the broker dead-lettered it: rejected, delivery_limit, ...
    from_queue: str | None
    deaths: int
    dead_at: datetime | None
    age_s: float | None
    content_type: str | None
    status: str | None = None  # the ledger row's, when there is one
    error_code: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplayOutcome:
    id: str | None
    replayed: bool
    ledger_reset: bool
    status_before: str | None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(v: Any) -> str | None:
    if v is None:
        return None
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def describe(message: AbstractIncomingMessage, now: datetime) -> DeadLetter:
    headers: dict[str, Any] = dict(message.headers or {})
    raw = headers.get("x-death")
    deaths: list[dict[str, Any]] = [d for d in raw if isinstance(d, dict)] if raw else []
    first = deaths[0] if deaths else {}
    when = first.get("time")
    if isinstance(when, datetime) and when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    total = sum(int(d.get("count") or 0) for d in deaths)
    return DeadLetter(
        id=message.message_id,
        size=len(message.body),
        reason=_text(headers.get("x-first-death-reason") or first.get("reason")),
        from_queue=_text(headers.get("x-first-death-queue") or first.get("queue")),
        deaths=total,
        dead_at=when if isinstance(when, datetime) else None,
        age_s=(now - when).total_seconds() if isinstance(when, datetime) else None,
        content_type=message.content_type,
    )


async def dead_letter_queue(channel: AbstractChannel, topo: Topology) -> AbstractQueue:
    """The dead-letter queue, which must exist (passive declare)."""
    try:
        return await channel.declare_queue(topo.dead_letter_queue, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise LookupError(
            f"no dead-letter queue {topo.dead_letter_queue!r} on the broker "
            "(check --queue / KVFLOW_QUEUE)"
        ) from None


def waiting(queue: AbstractQueue) -> int:
    """Ready messages as of the queue's (passive) declaration."""
    return int(queue.declaration_result.message_count or 0)


@contextlib.asynccontextmanager
async def held(queue: AbstractQueue, limit: int) -> AsyncIterator[list[AbstractIncomingMessage]]:
    """Up to `limit` messages taken without ack; every one still unsettled on exit is
    given back (nack + requeue)."""
    got: list[AbstractIncomingMessage] = []
    try:
        while len(got) < limit:
            m = await queue.get(no_ack=False, fail=False, timeout=10)
            if m is None:
                break
            got.append(m)
        yield got
    finally:
        for m in got:
            if not m.processed:
                with contextlib.suppress(Exception):
                    await m.nack(requeue=True)


async def peek(
    channel: AbstractChannel, topo: Topology, ledger: LedgerReader, limit: int
) -> tuple[int, list[DeadLetter]]:
    """(messages in the queue, up to `limit` of them described), leaving all in place."""
    queue = await dead_letter_queue(channel, topo)
    total = waiting(queue)
    now = datetime.now(UTC)
    async with held(queue, limit) as messages:
        letters = [describe(m, now) for m in messages]
    rows = await ledger.requests([x.id for x in letters if x.id])
    out = []
    for x in letters:
        row = rows.get(x.id or "")
        if row is not None:
            x = replace(x, status=row["status"], error_code=row["error_code"], error=row["error"])
        out.append(x)
    return max(total, len(out)), out


def republished(m: AbstractIncomingMessage) -> aio_pika.Message:
    """The original request: same body and properties, without the dead-letter headers."""
    headers = {k: v for k, v in (m.headers or {}).items() if not k.startswith(_DROPPED_HEADERS)}
    return aio_pika.Message(
        m.body,
        headers=headers,
        content_type=m.content_type,
        content_encoding=m.content_encoding,
        delivery_mode=m.delivery_mode or aio_pika.DeliveryMode.PERSISTENT,
        priority=m.priority,
        correlation_id=m.correlation_id,
        reply_to=m.reply_to,
        message_id=m.message_id,
        timestamp=m.timestamp,
        type=m.type,
        app_id=m.app_id,
    )


async def _replay_one(
    m: AbstractIncomingMessage, exchange: AbstractExchange, topo: Topology, ledger: LedgerStore
) -> ReplayOutcome:
    rid = m.message_id
    reset, before = (False, None)
    try:
        if rid:
            reset, before = await ledger.reopen_for_replay(rid)
        outcome = await exchange.publish(republished(m), routing_key=topo.queue, mandatory=True)
    except aiormq.exceptions.DeliveryError as e:
        await m.nack(requeue=True)
        return ReplayOutcome(rid, False, reset, before, f"the broker refused it: {e}")
    except BaseException:
        with contextlib.suppress(Exception):
            await m.nack(requeue=True)
        raise
    if isinstance(outcome, aiormq.abc.DeliveredMessage):  # returned: unroutable
        await m.nack(requeue=True)
        return ReplayOutcome(
            rid,
            False,
            reset,
            before,
            f"unroutable: no queue {topo.queue!r} bound to exchange {topo.exchange!r}",
        )
    await m.ack()
    return ReplayOutcome(rid, True, reset, before)


async def replay(
    channel: AbstractChannel,
    topo: Topology,
    ledger: LedgerStore,
    *,
    ids: set[str] | None,
    progress: bool = True,
) -> tuple[list[ReplayOutcome], set[str]]:
    """Replay every dead letter (ids None) or those with the given ids.

    Returns (outcomes, requested ids that were not found). `channel` must have
    publisher confirms on.
    """
    if not channel.publisher_confirms:
        raise ValueError("replay needs a channel with publisher confirms")
    queue = await dead_letter_queue(channel, topo)
    try:
        exchange = await channel.get_exchange(topo.exchange, ensure=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise AdminError(f"no request exchange {topo.exchange!r} on the broker") from None
    total = waiting(queue)
    wanted = set(ids) if ids is not None else None
    outcomes: list[ReplayOutcome] = []
    bar = tqdm(
        total=total if wanted is None else len(wanted),
        file=sys.stderr,
        unit="msg",
        desc="replay",
        disable=not progress,
    )
    try:
        # Messages scanned past (not asked for) stay held until the end, so a scan
        # sees each message once; then they are given back.
        async with held(queue, 0) as skipped:
            for _ in range(total):
                if wanted is not None and not wanted:
                    break
                m = await queue.get(no_ack=False, fail=False, timeout=10)
                if m is None:
                    break
                if wanted is not None and m.message_id not in wanted:
                    skipped.append(m)
                    continue
                if wanted is not None:
                    wanted.discard(str(m.message_id))
                outcomes.append(await _replay_one(m, exchange, topo, ledger))
                bar.update(1)
    finally:
        bar.close()
    return outcomes, wanted or set()


async def purge(channel: AbstractChannel, topo: Topology) -> int:
    """Drop every dead letter; returns how many there were."""
    queue = await dead_letter_queue(channel, topo)
    result = await queue.purge()
    return int(getattr(result, "message_count", 0) or 0)
