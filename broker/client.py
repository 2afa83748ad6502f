"""The producer client: submit requests to kvflow workers and await their replies.

    async with await Client.connect() as client:
        handle = await client.submit("Hello", max_tokens=32, stream=True)
        async for delta in handle.stream():
            print(delta["text"], end="")
        print(handle.final["usage"])

`broker.sync_client.SyncClient` offers the same for synchronous code.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)

from broker.connection import connect
from broker.errors import BrokerUnavailable, RequestFailed, SubmitFailed
from broker.handle import Handle
from broker.messages import (
    CONTENT_TYPE,
    ENQUEUED_AT_HEADER,
    SAMPLING_FIELDS,
    decode_reply,
    encode_request,
)
from broker.redact import redact_text, redact_url
from broker.topology import Topology, amqp_url_from_env, declare_request_path

# The errors and the handle are part of this module's interface (import them from here
# or from `broker`).
__all__ = ["BrokerUnavailable", "Client", "Handle", "RequestFailed", "SubmitFailed"]

log = logging.getLogger(__name__)


class Client:
    """An async producer: one connection, one exclusive reply queue, many requests.

    Build it with `await Client.connect(...)`. Replies are matched to requests by id.
    """

    def __init__(
        self,
        url: str,
        connection: AbstractConnection,
        channel: AbstractChannel,
        exchange: AbstractExchange,
        reply_queue: AbstractQueue,
        topology: Topology,
    ) -> None:
        self._url = url
        self._connection = connection
        self._channel = channel
        self._exchange = exchange
        self._reply_queue = reply_queue
        self.topology = topology
        self._pending: dict[str, Handle] = {}
        self._closing = False
        connection.close_callbacks.add(self._on_connection_closed)

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        queue: str | None = None,
        *,
        topology: Topology | None = None,
        declare_topology: bool = True,
        timeout: float = 10.0,
    ) -> Client:
        """Connect to `url` ($KVFLOW_AMQP_URL) and send to `queue` ($KVFLOW_QUEUE).

        Declares the request exchange and queues first (idempotent; not the control
        exchange, which is the workers' business) unless declare_topology is False.
        Raises BrokerUnavailable with the password redacted when RabbitMQ is unreachable.
        """
        url = amqp_url_from_env(url)
        topo = topology or Topology()
        if queue:
            topo = dataclasses.replace(topo, queue=queue)
        connection = await connect(url, timeout=timeout, name="kvflow client")
        try:
            channel = await connection.channel()
            if declare_topology:
                exchange = (await declare_request_path(channel, topo))[0]
            else:
                exchange = await channel.get_exchange(topo.exchange, ensure=False)
            reply_queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
            client = cls(url, connection, channel, exchange, reply_queue, topo)
            await reply_queue.consume(client._on_reply, no_ack=True)
        except BaseException:
            await connection.close()
            raise
        return client

    @property
    def reply_queue(self) -> str:
        return self._reply_queue.name

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        id: str | None = None,
        stream: bool = False,
        priority: int | None = None,
        deadline: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait_reply: bool = True,
        client: str | None = None,
        **sampling: Any,
    ) -> Handle:
        """Publish one request; returns once the broker has confirmed it (persistent).

        `sampling` takes the contract's sampling fields (max_tokens, temperature, ...).
        With wait_reply=False no reply_to is set: the result goes to the ledger only.
        `client` names the producer service the request is accounted to (fair sharing).
        Raises InvalidRequest (a ValueError) for a request the worker would refuse,
        SubmitFailed when the broker does not take it.
        """
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"submit() got unknown keyword argument(s): {', '.join(unknown)}")
        request_id = id or uuid.uuid4().hex
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already pending on this client")
        body = encode_request(
            id=request_id,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            priority=priority,
            deadline=deadline,
            stream=stream,
            metadata=metadata,
            client=client,
        )
        now = time.time()
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=request_id,
            correlation_id=request_id,
            timestamp=now,
            # A string: pamqp would send a Python float as a 32-bit float.
            headers={ENQUEUED_AT_HEADER: f"{now:.6f}"},
            reply_to=self._reply_queue.name if wait_reply else None,
        )
        handle = Handle(request_id, waits=wait_reply)
        if wait_reply:
            self._pending[request_id] = handle  # before publishing: replies can be fast
        try:
            outcome = await self._exchange.publish(
                message, routing_key=self.topology.queue, mandatory=True
            )
        except aiormq.exceptions.DeliveryError as e:
            self._pending.pop(request_id, None)
            raise SubmitFailed(f"the broker refused request {request_id!r}: {e}") from None
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        if isinstance(outcome, aiormq.abc.DeliveredMessage):
            self._pending.pop(request_id, None)
            raise SubmitFailed(
                f"request {request_id!r} was not routed: no queue {self.topology.queue!r} "
                f"bound to exchange {self.topology.exchange!r}"
            )
        return handle

    async def close(self) -> None:
        """Close the connection; pending handles fail with BrokerUnavailable."""
        self._closing = True
        self._fail_pending(BrokerUnavailable("the client was closed before the reply came"))
        if not self._connection.is_closed:
            await self._connection.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            reply = decode_reply(message.body)
        except ValueError as e:
            log.warning(
                "dropping a malformed reply (correlation_id %r): %s", message.correlation_id, e
            )
            return
        key = reply.get("id") or message.correlation_id
        handle = self._pending.get(str(key)) if key is not None else None
        if handle is None and message.correlation_id:
            handle = self._pending.get(message.correlation_id)
        if handle is None:
            log.debug("reply for unknown request %r dropped", key)
            return
        handle._deliver(reply)
        if handle.done:
            self._pending.pop(handle.id, None)

    def _on_connection_closed(self, _sender: Any, exc: BaseException | None = None) -> None:
        if not self._closing:
            reason = redact_text(str(exc), self._url) if exc else "closed"
            self._fail_pending(
                BrokerUnavailable(f"connection to {redact_url(self._url)} lost: {reason}")
            )

    def _fail_pending(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for handle in pending.values():
            handle._fail(error)
