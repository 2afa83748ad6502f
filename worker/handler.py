"""One delivery, end to end: decode, check, run, reply, record, acknowledge.

The order of the last three is the delivery guarantee: a message is acked only after
its final ledger row is committed and its final reply is confirmed by the broker. A
worker that dies before that leaves the message unacked, and RabbitMQ redelivers it;
the ledger (one row per id) makes the rerun land exactly once, and a redelivery of a
request that already completed is answered from the ledger without running the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from broker.messages import (
    CANCELLED,
    EXPIRED,
    INTERNAL,
    INVALID_REQUEST,
    PROMPT_TOO_LONG,
    InvalidRequest,
    RequestMessage,
    decode_request,
    encode_delta,
    encode_error,
    encode_result,
)
from broker.publisher import ReplyPublisher
from worker.config import ServiceConfig
from worker.engine.async_engine import EngineFront
from worker.engine.outputs import RequestOutput
from worker.ledger.store import LedgerClosed, LedgerStore, LedgerWriteError, RequestRecord
from worker.model.tokenizer import Tokenizer
from worker.outcome import Outcome, final_record, timing_from_record, timing_of, utc
from worker.request import FinishReason, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HandlerEvents:
    """Callbacks the service uses for metrics; every one is optional."""

    on_received: Callable[[AbstractIncomingMessage], None] | None = None
    on_finished: Callable[[RequestOutput, RequestMessage], None] | None = None
    on_outcome: Callable[[str], None] | None = None  # acked | rejected | requeued | replayed
    extra: dict[str, Any] = field(default_factory=dict)


class RequestHandler:
    """Serves deliveries for one worker (shared by all of its in-flight requests)."""

    def __init__(
        self,
        engine: EngineFront,
        tokenizer: Tokenizer,
        ledger: LedgerStore,
        publisher: ReplyPublisher,
        config: ServiceConfig,
        worker_id: str,
        model_name: str,
        events: HandlerEvents | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.publisher = publisher
        self.config = config
        self.worker_id = worker_id
        self.model_name = model_name
        self.events = events or HandlerEvents()
        # Ids to give back to the queue instead of cancelling (drain, shutdown).
        self.requeue_ids: set[str] = set()
        # False once a drain gives up waiting: requests not yet in the engine go back.
        self.accepting = True
        # Ids cancelled by an operator before their message arrived here (bounded).
        self.cancelled_ids: OrderedDict[str, None] = OrderedDict()
        # Extra deliveries of a request that is already being served here (a redelivery
        # after a reconnect, a producer's retry): acked together with the first, or
        # given back to the queue if the first ends without an outcome.
        self._duplicates: dict[str, list[AbstractIncomingMessage]] = {}
        self._serving: set[str] = set()  # ids between decode and their last message

    def remember_cancelled(self, request_id: str, keep: int = 10_000) -> None:
        self.cancelled_ids[request_id] = None
        while len(self.cancelled_ids) > keep:
            self.cancelled_ids.popitem(last=False)

    async def handle(
        self, message: AbstractIncomingMessage, admitted: Callable[[], None] = lambda: None
    ) -> None:
        """Serve one delivery; `admitted()` is called once the engine holds the request."""
        received = time.time()
        if self.events.on_received:
            self.events.on_received(message)
        try:
            req = decode_request(
                message.body,
                content_type=message.content_type,
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                timestamp=message.timestamp,
                expiration=_seconds(message.expiration),
                headers=message.headers,
                redelivered=bool(message.redelivered),
                max_message_bytes=self.config.max_message_bytes,
                received_at=received,
            )
        except InvalidRequest as e:
            rid = e.request_id or f"invalid-{uuid.uuid4().hex}"
            await self._reject(
                message, rid, e.code, e.message, e.reply_to, e.correlation_id, received
            )
            return
        if req.id in self._serving or self.engine.is_running(req.id):
            self._duplicates.setdefault(req.id, []).append(message)
            return
        self._serving.add(req.id)
        try:
            await self._serve(message, req, received, admitted)
        except LedgerClosed:
            await self._requeue(message, req.id)
        except Exception:
            log.exception("request %s failed inside the worker", req.id)
            await self._fail(message, req, received)
        finally:
            self._serving.discard(req.id)
            self.requeue_ids.discard(req.id)
            # Duplicates not settled with the first delivery go back to the queue: a
            # redelivery is answered from the ledger, or runs if nothing was recorded.
            for m in self._duplicates.pop(req.id, []):
                with contextlib.suppress(Exception):
                    await m.nack(requeue=True)

    # -- the normal path -------------------------------------------------------------------

    async def _serve(
        self,
        message: AbstractIncomingMessage,
        req: RequestMessage,
        received: float,
        admitted: Callable[[], None],
    ) -> None:
        if req.id in self.cancelled_ids:
            del self.cancelled_ids[req.id]
            await self._terminal_error(
                message, req, received, "cancelled", CANCELLED, "cancelled by an operator"
            )
            return
        if req.deadline is not None and received >= req.deadline:
            await self._terminal_error(
                message,
                req,
                received,
                "expired",
                EXPIRED,
                "the request's deadline passed before it started",
            )
            return
        existing = await self.ledger.mark_received(
            req.id,
            model=self.model_name,
            prompt=req.prompt,
            priority=req.priority,
            worker_id=self.worker_id,
            enqueued_at=utc(req.enqueued_at),
            received_at=utc(received),
            metadata=req.metadata,
            source="queue",
        )
        if existing is not None:
            await self._answer_from_ledger(message, req, existing)
            return
        try:
            tokens = await self._tokens(req)
            fields = {"max_tokens": self.config.default_max_tokens, **req.sampling}
            params = SamplingParams(**fields)
        except (ValueError, TypeError) as e:
            await self._reject(
                message, req.id, INVALID_REQUEST, str(e), req.reply_to, req.correlation_id, received
            )
            return
        # Checked again here: a cancel or a drain may have come while this request was
        # being recorded and tokenized.
        if req.id in self.cancelled_ids:
            del self.cancelled_ids[req.id]
            await self._terminal_error(
                message, req, received, "cancelled", CANCELLED, "cancelled by an operator"
            )
            return
        if not self.accepting or self.engine.error is not None:
            await self._requeue(message, req.id)
            return
        try:
            stream = self.engine.add_request(
                req.id,
                tokens,
                params,
                arrival_time=req.enqueued_at if req.enqueued_at is not None else received,
                priority=req.priority or 0,
                deadline=req.deadline,
            )
            admitted()
        except (ValueError, TypeError) as e:
            code = PROMPT_TOO_LONG if "the prompt has" in str(e) else INVALID_REQUEST
            await self._reject(
                message, req.id, code, str(e), req.reply_to, req.correlation_id, received
            )
            return

        index = 0
        final: RequestOutput | None = None
        try:
            async for out in stream:
                has_delta = bool(out.delta_text or out.delta_token_ids)
                if req.stream and req.reply_to and has_delta and out.error is None:
                    await self.publisher.publish(
                        req.reply_to,
                        req.correlation_id,
                        encode_delta(req.id, index, out.delta_text, out.delta_token_ids),
                    )
                    index += 1
                if out.finished:
                    final = out
        finally:
            if final is None:  # a delta could not be sent: nobody reads the stream now
                self.engine.abort(req.id)
        assert final is not None
        await self._finish(message, req, final, received, len(tokens))

    async def _tokens(self, req: RequestMessage) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            # The first chat template render imports transformers (~1 s): off the loop.
            return await asyncio.to_thread(self.tokenizer.encode_chat, list(req.messages))
        assert req.prompt is not None
        return self.tokenizer.encode(req.prompt)

    async def _finish(
        self,
        message: AbstractIncomingMessage,
        req: RequestMessage,
        out: RequestOutput,
        received: float,
        prompt_tokens: int,
    ) -> None:
        if out.finish_reason == FinishReason.ABORT and req.id in self.requeue_ids:
            self.requeue_ids.discard(req.id)
            await self._requeue(message, req.id)
            return
        outcome = Outcome.of(out)
        timing = timing_of(out, req.enqueued_at, received)
        record = final_record(
            req.id,
            out,
            outcome,
            timing,
            model=self.model_name,
            worker_id=self.worker_id,
            source="queue",
            prompt_tokens=prompt_tokens,
        )
        committed = self.ledger.record(record)
        if self.events.on_finished:
            self.events.on_finished(out, req)
        if outcome.code is None:
            body = encode_result(
                req.id,
                text=out.text,
                token_ids=out.token_ids,
                finish_reason=record.finish_reason or "stop",
                prompt_tokens=record.prompt_tokens or 0,
                completion_tokens=len(out.token_ids),
                timing=timing,
                worker=self.worker_id,
                metadata=req.metadata,
            )
        else:
            body = encode_error(req.id, outcome.code, outcome.error or "the request failed")
        await self._reply_final(req, record, await committed, body)
        await self._ack(message, req.id)

    async def _reply_final(
        self,
        req: RequestMessage,
        mine: RequestRecord,
        stored: RequestRecord | None,
        body: bytes,
    ) -> None:
        """Send the final reply once the ledger row is committed: ours, unless the ledger
        holds another delivery's outcome (two workers ran the request after a redelivery,
        and the other committed first). The producer then sees what the ledger keeps."""
        if not req.reply_to:
            return
        if stored is not None and not _same_outcome(stored, mine):
            log.warning(
                "request %s: another delivery's outcome (%s by %s) was recorded first; "
                "replying with it",
                req.id,
                stored.status,
                stored.worker_id,
            )
            body = self._ledger_reply(req, stored)
        await self.publisher.publish(req.reply_to, req.correlation_id, body)

    async def _ack(self, message: AbstractIncomingMessage, rid: str) -> None:
        for m in [message, *self._duplicates.pop(rid, [])]:
            try:
                await m.ack()
            except Exception as e:  # channel gone: the broker redelivers, the ledger answers
                log.warning(
                    "could not ack %s (%r); a redelivery will be answered from the ledger", rid, e
                )
        self._outcome("acked")

    # -- the other outcomes --------------------------------------------------------------

    async def _reject(
        self,
        message: AbstractIncomingMessage,
        rid: str,
        code: str,
        text: str,
        reply_to: str | None,
        correlation_id: str | None,
        received: float,
    ) -> None:
        """Bad input: error reply, a 'rejected' row, and the message to the dead-letter queue."""
        log.info("rejected %s: %s", rid, text)
        committed = self.ledger.record(
            RequestRecord(
                id=rid,
                status="rejected",
                error=text,
                error_code=code,
                worker_id=self.worker_id,
                received_at=utc(received),
                finished_at=utc(time.time()),
                source="queue",
            )
        )
        if reply_to:
            await self.publisher.publish(
                reply_to, correlation_id or rid, encode_error(rid, code, text)
            )
        try:
            await committed
        except LedgerWriteError as e:  # the dead-letter queue still keeps the message
            log.error("rejected %s without a ledger row: %s", rid, e)
        await message.reject(requeue=False)
        self._outcome("rejected")

    async def _terminal_error(
        self,
        message: AbstractIncomingMessage,
        req: RequestMessage,
        received: float,
        status: str,
        code: str,
        text: str,
    ) -> None:
        """Expired or cancelled before it ran: recorded, answered, acked (not dead-lettered)."""
        record = RequestRecord(
            id=req.id,
            status=status,
            error=text,
            error_code=code,
            worker_id=self.worker_id,
            priority=req.priority,
            enqueued_at=utc(req.enqueued_at),
            received_at=utc(received),
            finished_at=utc(time.time()),
            metadata=req.metadata,
            source="queue",
        )
        stored = await self.ledger.record(record)
        await self._reply_final(req, record, stored, encode_error(req.id, code, text))
        await self._ack(message, req.id)

    async def _answer_from_ledger(
        self, message: AbstractIncomingMessage, req: RequestMessage, rec: RequestRecord
    ) -> None:
        """A redelivery of a request that already ended: resend its outcome, run nothing."""
        if req.reply_to:
            body = self._ledger_reply(req, rec)
            await self.publisher.publish(req.reply_to, req.correlation_id, body)
        await self._ack(message, req.id)
        self._outcome("replayed")

    def _ledger_reply(self, req: RequestMessage, rec: RequestRecord) -> bytes:
        """The final reply message for a request as its ledger row records it."""
        if rec.status in ("completed", "expired") and rec.output_text is not None:
            body = encode_result(
                req.id,
                text=rec.output_text,
                token_ids=list(rec.output_token_ids or []),
                finish_reason=rec.finish_reason or "stop",
                prompt_tokens=rec.prompt_tokens or 0,
                completion_tokens=rec.completion_tokens or 0,
                timing=timing_from_record(rec),
                worker=rec.worker_id or self.worker_id,
                metadata=rec.metadata,
            )
        else:
            code = rec.error_code or {"cancelled": CANCELLED, "expired": EXPIRED}.get(
                rec.status, INVALID_REQUEST
            )
            body = encode_error(req.id, code, rec.error or f"the request was {rec.status}")
        return body

    async def _requeue(self, message: AbstractIncomingMessage, rid: str) -> None:
        """Give an unfinished request back to the queue (drain, shutdown): never dead-lettered.

        Its ledger row stays 'running' until the next delivery takes it up again.
        """
        for m in [message, *self._duplicates.pop(rid, [])]:
            try:
                await m.nack(requeue=True)
            except Exception as e:
                log.warning(
                    "could not requeue %s (%s); the broker requeues it when the channel closes",
                    rid,
                    e,
                )
        self._outcome("requeued")

    async def _fail(
        self, message: AbstractIncomingMessage, req: RequestMessage, received: float
    ) -> None:
        """An internal error: retry elsewhere, unless this was the last delivery allowed."""
        last = (req.delivery_count or 0) + 1 >= self.config.delivery_limit
        if not last:
            await self._requeue(message, req.id)
            return
        text = "internal error while serving the request (see the worker's log)"
        try:
            record = RequestRecord(
                id=req.id,
                status="failed",
                error=text,
                error_code=INTERNAL,
                worker_id=self.worker_id,
                finished_at=utc(time.time()),
            )
            stored = await self.ledger.record(record)
            await self._reply_final(req, record, stored, encode_error(req.id, INTERNAL, text))
        finally:
            await message.reject(requeue=False)
            self._outcome("rejected")

    def _outcome(self, what: str) -> None:
        if self.events.on_outcome:
            self.events.on_outcome(what)


def _seconds(expiration: object) -> float | None:
    """aio-pika gives the AMQP expiration as seconds (number or timedelta)."""
    if expiration is None:
        return None
    if isinstance(expiration, timedelta):
        return expiration.total_seconds()
    if isinstance(expiration, (int, float)):
        return float(expiration)
    return None


def _same_outcome(a: RequestRecord, b: RequestRecord) -> bool:
    return (a.status, a.worker_id, a.finished_at) == (b.status, b.worker_id, b.finished_at)
