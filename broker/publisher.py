"""Publish replies (deltas, results, errors) to a request's reply_to queue."""

from __future__ import annotations

import logging

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel

from broker.messages import CONTENT_TYPE

log = logging.getLogger(__name__)


class ReplyPublisher:
    """Sends encoded replies through the default exchange with publisher confirms.

    A reply that cannot be delivered (its queue is gone, or the broker refuses it) is
    logged and reported as False, never raised: the result is in the ledger anyway.
    Connection and channel errors do propagate.
    """

    def __init__(self, channel: AbstractChannel) -> None:
        if not channel.publisher_confirms:
            raise ValueError("ReplyPublisher needs a channel opened with publisher_confirms=True")
        self._channel = channel

    async def publish(self, reply_to: str, correlation_id: str | None, body: bytes) -> bool:
        """Publish `body` to queue `reply_to`; returns once the broker has confirmed it.

        Returns True when the broker routed and confirmed the reply, False when it was
        unroutable (mandatory publish returned) or nacked.
        """
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            correlation_id=correlation_id,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
        )
        try:
            # With confirms on, this await ends on the broker's Ack, Nack or Return.
            outcome = await self._channel.default_exchange.publish(
                message, routing_key=reply_to, mandatory=True
            )
        except aio_pika.exceptions.PublishError:
            # Channels opened with on_return_raises=True report a return this way.
            log.warning(
                "reply to %r for %r was unroutable: no such queue", reply_to, correlation_id
            )
            return False
        except aiormq.exceptions.DeliveryError as e:
            log.warning("broker refused the reply to %r for %r: %s", reply_to, correlation_id, e)
            return False
        if isinstance(outcome, aiormq.abc.DeliveredMessage):
            log.warning(
                "reply to %r for %r was unroutable: no such queue", reply_to, correlation_id
            )
            return False
        return True
