"""Publish replies (deltas, results, errors) to a request's reply_to queue, and requests
back onto their own queue (`Requeuer`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from broker.messages import CONTENT_TYPE

log = logging.getLogger(__name__)

RESTORE_WAIT_S = 30.0  # how long a publish waits for its channel to be back after a reconnect


async def open_channel(channel: AbstractChannel) -> aiormq.Channel:
    """`channel`'s current AMQP channel, once it is open again after a reconnect (bounded).

    A robust connection comes back before its channels, and restores them one by one:
    a consumer on one may be delivering again while the publishing one is still closed.
    Without this wait, the replies of those deliveries fail at once, and each delivery
    goes back to its queue in a loop that spends a delivery count per turn until the
    broker dead-letters it.
    """
    ready = getattr(channel, "ready", None)  # robust channels only
    if ready is not None and channel.is_closed:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTORE_WAIT_S
        # The AMQP channel is marked closed a few callbacks before aio-pika marks the
        # robust one as being restored: `ready()` may return while it is still closed.
        while channel.is_closed:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"channel not restored within {RESTORE_WAIT_S:.0f} s")
            await asyncio.wait_for(ready(), left)
            if channel.is_closed:
                await asyncio.sleep(min(0.05, left))
    return cast(aiormq.Channel, await channel.get_underlay_channel())


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

        The frames are handed to the connection's writer without waiting for them to be
        written (`wait=False`), so the channel's lock is not held across event-loop
        turns: the replies of one turn leave in one socket write and their confirms are
        awaited together, each by its own caller.
        """
        properties = aiormq.spec.Basic.Properties(
            content_type=CONTENT_TYPE, correlation_id=correlation_id, delivery_mode=1
        )
        try:
            channel = await open_channel(self._channel)
            # With confirms on, this await ends on the broker's Ack, Nack or Return.
            outcome = await channel.basic_publish(
                body, routing_key=reply_to, properties=properties, mandatory=True, wait=False
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


class Requeuer:
    """Puts a delivered request back onto its queue as a new message (publisher confirms).

    A broker requeue (`nack(requeue=True)`) counts toward the queue's delivery limit; a
    new message starts from zero. The worker uses this for returns that are not the
    request's fault (its engine died), with kvflow's own counts in `headers`.
    """

    def __init__(self, channel: AbstractChannel, queue: str) -> None:
        if not channel.publisher_confirms:
            raise ValueError("Requeuer needs a channel opened with publisher_confirms=True")
        self._channel = channel
        self._queue = queue

    async def republish(self, message: AbstractIncomingMessage, headers: Mapping[str, Any]) -> None:
        """Publish a copy of `message` (body and properties, `headers` merged into its
        headers) to the queue and wait for the broker's confirm; raises if it is not
        confirmed (the caller then keeps the original)."""
        # The delivered message's own properties (a fresh object each time it is read),
        # not an aio_pika.Message built field by field: the fair-mode router republishes
        # every request, and that construction was half of its cost.
        properties = message.properties
        headers = {**(message.headers or {}), **headers}
        headers.pop("x-delivery-count", None)  # the broker's, for the old message
        properties.headers = headers
        properties.delivery_mode = int(aio_pika.DeliveryMode.PERSISTENT)
        properties.user_id = None  # the broker checks it against our login; app_id stays
        # As ReplyPublisher: handed to the writer without holding the channel's lock
        # across turns; the confirm is still awaited.
        channel = await open_channel(self._channel)
        outcome = await channel.basic_publish(
            message.body,
            routing_key=self._queue,
            properties=properties,
            mandatory=True,
            wait=False,
        )
        if isinstance(outcome, aiormq.abc.DeliveredMessage):
            raise RuntimeError(f"queue {self._queue!r} did not take the message back")
