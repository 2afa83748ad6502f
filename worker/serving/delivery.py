"""One delivery, from the message to its outcome: decode, check, admit, stream, finish.

`Delivery.handle` decides what becomes of a message; `Settlement` carries it out
(commit, reply, ack). The path of a request that runs:

1. decode the body under contract v1 (bad input: rejected, dead-lettered);
2. a second delivery of an id already served here parks behind the first;
3. cancelled by an operator, or past its deadline: ended without running;
4. build the engine request (one builder for every input format: defaults, limits);
5. mark it received in the ledger; an id that already ended is answered from there;
6. checked again just before it enters the engine: cancelled? still accepting work?
7. stream deltas to the producer while the engine runs it;
8. the final record and reply, settled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from aio_pika.abc import AbstractIncomingMessage

from broker.messages import InvalidRequest, RequestMessage, decode_request
from worker.builder import EngineRequest, Prompt, RequestBuilder
from worker.engine.async_engine import EngineFront, RequestStream
from worker.engine.outputs import RequestOutput
from worker.ledger import LedgerClosed, LedgerStore, RequestSource
from worker.metrics import MessageEvent, Metrics
from worker.model.sampler import TokenLogprobs
from worker.outcome import Outcome, queue_delay_text, returned_text
from worker.records import Origin, error_record, final_record, received_fields, timing_of
from worker.request import FinishReason, InvalidInput
from worker.serving.drain import DrainState, GiveBack
from worker.serving.isolation import Isolation
from worker.serving.lanes import Lanes
from worker.serving.replies import Address, Replier, error_body, result_body
from worker.serving.settlement import Return, Settlement

log = logging.getLogger(__name__)


class Delivery:
    """Serves the deliveries of one worker (shared by all of its in-flight requests)."""

    def __init__(
        self,
        *,
        engine: EngineFront,
        builder: RequestBuilder,
        ledger: LedgerStore,
        replier: Replier,
        settlement: Settlement,
        drain: DrainState,
        metrics: Metrics,
        worker_id: str,
        default_max_tokens: int,
        max_message_bytes: int,
        max_request_s: float,
        isolation: Isolation,
        max_queue_delay_s: float | None = None,
        lanes: Lanes | None = None,
    ) -> None:
        self.engine = engine
        self.builder = builder
        self.ledger = ledger
        self.replier = replier
        self.settle = settlement
        self.drain = drain
        self.metrics = metrics
        self.worker_id = worker_id
        self.model_name = engine.info.model_name
        self.default_max_tokens = default_max_tokens
        self.max_message_bytes = max_message_bytes
        self.max_request_s = max_request_s
        self.isolation = isolation
        self.max_queue_delay_s = max_queue_delay_s
        self.lanes = lanes

    async def handle(
        self, message: AbstractIncomingMessage, admitted: Callable[[], None] = lambda: None
    ) -> None:
        """Serve one delivery; `admitted()` is called once the engine holds the request."""
        received = time.time()
        self.metrics.on_message(MessageEvent.RECEIVED)
        if message.redelivered:
            self.metrics.on_message(MessageEvent.REDELIVERED)
        try:
            req = self._decode(message, received)
        except InvalidRequest as e:
            rid = e.request_id or f"invalid-{uuid.uuid4().hex}"
            to = Address(rid, e.reply_to, e.correlation_id or rid)
            outcome = Outcome.error_of(e.code, e.message)
            origin = Origin(self.worker_id, RequestSource.QUEUE, received_at=received)
            await self.settle.reject(
                message, to, error_record(rid, outcome, origin), error_body(rid, outcome)
            )
            return
        to = Address(req.id, req.reply_to, req.correlation_id)
        if not self.settle.claim(req.id):
            await self.settle.park(req.id, message, to)
            return
        origin = Origin(  # the priority joins once the builder has checked it
            self.worker_id,
            RequestSource.QUEUE,
            model=self.model_name,
            enqueued_at=req.enqueued_at,
            received_at=received,
            metadata=req.metadata,
            client=req.client,
        )
        try:
            await self._serve(message, req, to, origin, admitted)
        except LedgerClosed:  # shutting down: nothing can be recorded any more
            await self.settle.requeue(message, req.id)
        except Exception:
            log.exception("request %s failed inside the worker", req.id)
            await self.settle.give_back(message, self._return(GiveBack.REQUEUE, req, to, origin))
        finally:
            self.drain.forget(req.id)
            await self.settle.release(req.id)

    def _decode(self, message: AbstractIncomingMessage, received: float) -> RequestMessage:
        return decode_request(
            message.body,
            content_type=message.content_type,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            timestamp=message.timestamp,
            expiration=_seconds(message.expiration),
            headers=message.headers,
            redelivered=bool(message.redelivered),
            max_message_bytes=self.max_message_bytes,
            received_at=received,
            app_id=message.app_id,
        )

    async def _serve(
        self,
        message: AbstractIncomingMessage,
        req: RequestMessage,
        to: Address,
        origin: Origin,
        admitted: Callable[[], None],
    ) -> None:
        if await self._ended_before_start(message, req, to, origin):
            return
        try:
            built = await self._build(req, origin)
        except InvalidInput as e:
            outcome = Outcome.invalid(e)
            await self.settle.reject(
                message, to, error_record(req.id, outcome, origin), error_body(req.id, outcome)
            )
            return
        origin = replace(origin, priority=built.priority)  # checked: the ledger can hold it
        existing = await self.ledger.mark_received(req.id, **received_fields(origin, req.prompt))
        if existing is not None:
            await self.settle.replay(message, to, existing)
            return
        # Checked again: a cancel or a drain may have come while it was recorded and built.
        if await self._ended_before_start(message, req, to, origin):
            return
        async with self.isolation.enter(suspect=req.crashes > 0):
            if not self.drain.accepting or self.engine.error is not None:
                down = GiveBack.ENGINE_DOWN if self.engine.error else GiveBack.REQUEUE
                await self.settle.give_back(message, self._return(down, req, to, origin))
                return
            self._queued(req.client, len(built.prompt_token_ids))
            stream = self.engine.add_request(
                built.request_id,
                built.prompt_token_ids,
                built.params,
                arrival_time=origin.received_at,
                priority=built.priority,
                deadline=built.deadline,
                client=req.client,
            )
            admitted()
            final, logprobs = await self._stream(req, to, stream, built)
            why: GiveBack | None = None
            if final.finish_reason == FinishReason.ABORT:
                why = self.drain.given_back(req.id)
            if why is GiveBack.CRASHED and req.crashes > 0 and self.isolation.alone:
                why = GiveBack.CRASHED_ALONE  # a suspect, alone in the engine: the cause
        if why is not None:
            await self.settle.give_back(message, self._return(why, req, to, origin))
            return
        record = final_record(req.id, final, origin, prompt_tokens=len(built.prompt_token_ids))
        timing = timing_of(final, origin.enqueued_at, origin.received_at)
        self.metrics.on_finished(final, timing, req.client)
        body = result_body(req.id, final, record, timing, self.worker_id, req.metadata, logprobs)
        await self.settle.conclude(message, to, record, body)

    async def _ended_before_start(
        self, message: AbstractIncomingMessage, req: RequestMessage, to: Address, origin: Origin
    ) -> bool:
        """Cancelled by an operator, past its deadline or the worker's queue-delay limit,
        or on the last delivery the queue allows after earlier ones that never settled:
        recorded, answered, settled."""
        if self.settle.last_delivery(req.delivery_count):
            count = (req.delivery_count or 0) + 1
            outcome = Outcome.internal(returned_text(count))
            await self.settle.dead_letter(
                message, to, error_record(req.id, outcome, origin), error_body(req.id, outcome)
            )
            return True
        now = time.time()
        waited = now - origin.enqueued_at if origin.enqueued_at is not None else 0.0
        if self.drain.take_cancelled(req.id):
            outcome = Outcome.cancelled()
        elif req.deadline is not None and now >= req.deadline:
            outcome = Outcome.expired()
        elif self.max_queue_delay_s is not None and waited > self.max_queue_delay_s:
            outcome = Outcome.expired(queue_delay_text(waited, self.max_queue_delay_s))
        else:
            return False
        record = error_record(req.id, outcome, origin)
        await self.settle.conclude(message, to, record, error_body(req.id, outcome))
        return True

    async def _build(self, req: RequestMessage, origin: Origin) -> EngineRequest:
        prompt = Prompt(req.prompt, req.messages, req.prompt_token_ids)
        if prompt.needs_template:
            # The first chat template render imports jinja (~1 s): off the event loop.
            tokens = await asyncio.to_thread(self.builder.tokenize, prompt)
        else:
            tokens = self.builder.tokenize(prompt)
        return self.builder.build(
            req.id,
            tokens,
            req.sampling,
            default_max_tokens=self.default_max_tokens,
            priority=req.priority,
            # The engine ends it in time for the ack to beat the broker's consumer timeout.
            deadline=min(
                req.deadline or math.inf, (origin.received_at or time.time()) + self.max_request_s
            ),
        )

    async def _stream(
        self, req: RequestMessage, to: Address, stream: RequestStream, built: EngineRequest
    ) -> tuple[RequestOutput, list[TokenLogprobs] | None]:
        """Relay deltas while the engine runs the request; returns its final output and,
        when asked for, the logprobs of every generated token."""
        wants_logprobs = built.params.logprobs is not None
        logprobs: list[TokenLogprobs] | None = [] if wants_logprobs else None
        index = 0
        final: RequestOutput | None = None
        waiting = len(built.prompt_token_ids)  # queued prompt tokens, until it starts
        try:
            async for out in stream:
                if waiting:
                    self._queued(req.client, -waiting)
                    waiting = 0
                if logprobs is not None and out.logprobs:
                    logprobs.extend(out.logprobs)
                has_delta = bool(out.delta_text or out.delta_token_ids)
                if req.stream and to.wanted and has_delta and out.error is None:
                    await self.replier.delta(to, index, out, wants_logprobs)
                    index += 1
                if out.finished:
                    final = out
        finally:
            if waiting:
                self._queued(req.client, -waiting)
            if final is None:  # a delta could not be sent: nobody reads the stream now
                self.engine.abort(req.id)
        assert final is not None
        return final, logprobs

    def _queued(self, client: str, tokens: int) -> None:
        """Fair mode's admission control: prompt tokens of `client` waiting here."""
        if self.lanes is not None:
            self.lanes.queue_tokens(client, tokens)
            self.metrics.set_queued_tokens(client, self.lanes.queued_tokens[client])

    def _return(self, why: GiveBack, req: RequestMessage, to: Address, origin: Origin) -> Return:
        return Return(why, req.id, req.delivery_count, req.crashes, to, origin)


def _seconds(expiration: object) -> float | None:
    """aio-pika gives the AMQP expiration as seconds (number or timedelta)."""
    if expiration is None:
        return None
    if isinstance(expiration, timedelta):
        return expiration.total_seconds()
    if isinstance(expiration, (int, float)):
        return float(expiration)
    return None
