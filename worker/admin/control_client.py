"""The CLI's end of the control plane: broadcast a command, collect the replies.

A command goes to the fanout exchange (`Topology.control_exchange`) with `reply_to` set
to this client's exclusive queue; every worker (and a `kvflow up` supervisor) sees it,
and those it addresses answer there (wire format in `broker.control`). Replies are
collected for a window, or until a predicate over what arrived says enough: silence
within a window does not prove a worker dead, only that it did not answer in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from types import TracebackType

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)

from broker.connection import connect
from broker.control import ALL, ControlCommand, ControlReply
from broker.topology import Topology

log = logging.getLogger(__name__)

Enough = Callable[[list[ControlReply]], bool]


class ControlClient:
    """One connection, one exclusive reply queue; commands and their replies by id."""

    def __init__(
        self,
        connection: AbstractConnection,
        channel: AbstractChannel,
        exchange: AbstractExchange,
        replies: AbstractQueue,
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._exchange = exchange
        self._replies = replies
        self._inbox: dict[str, asyncio.Queue[ControlReply]] = {}

    @classmethod
    async def open(cls, url: str, topology: Topology, *, timeout: float = 10.0) -> ControlClient:
        """Connect and listen; BrokerUnavailable if RabbitMQ cannot be reached."""
        connection = await connect(url, timeout=timeout, name="kvflow admin control")
        try:
            channel = await connection.channel()
            # Declared as the workers declare it, so a command sent before any worker
            # ever started is simply heard by nobody instead of closing the channel.
            exchange = await channel.declare_exchange(
                topology.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True
            )
            replies = await channel.declare_queue("", exclusive=True, auto_delete=True)
            client = cls(connection, channel, exchange, replies)
            await replies.consume(client._on_reply, no_ack=True)
        except BaseException:
            await connection.close()
            raise
        return client

    async def close(self) -> None:
        if not self._connection.is_closed:
            await self._connection.close()

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def send(self, cmd: ControlCommand) -> None:
        """Broadcast `cmd`; its replies are kept for `collect`."""
        self._inbox.setdefault(cmd.id, asyncio.Queue())
        message = aio_pika.Message(
            cmd.encode(),
            content_type="application/msgpack",
            correlation_id=cmd.id,
            reply_to=self._replies.name,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            expiration=120,  # a command nobody read in two minutes is stale
        )
        await self._exchange.publish(message, routing_key="")

    async def collect(
        self, ids: Iterable[str], *, timeout: float, enough: Enough | None = None
    ) -> list[ControlReply]:
        """Replies to the commands `ids` that arrive within `timeout` seconds; returns
        early once `enough(replies so far)` is true."""
        inboxes = [self._inbox.setdefault(i, asyncio.Queue()) for i in ids]
        got: list[ControlReply] = []
        until = time.monotonic() + timeout
        while not (enough and enough(got)):
            for box in inboxes:
                while not box.empty():
                    got.append(box.get_nowait())
            if enough and enough(got):
                break
            left = until - time.monotonic()
            if left <= 0:
                break
            waits = [asyncio.ensure_future(box.get()) for box in inboxes]
            done, pending = await asyncio.wait(
                waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for w in pending:
                w.cancel()
            for w in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await w
            got.extend(w.result() for w in done)
        return got

    async def call(
        self, cmd: ControlCommand, *, timeout: float, enough: Enough | None = None
    ) -> list[ControlReply]:
        """send + collect for one command."""
        await self.send(cmd)
        return await self.collect([cmd.id], timeout=timeout, enough=enough)

    async def discover(self, queue: str | None, *, window: float) -> list[ControlReply]:
        """Ping every worker; the replies of those serving `queue` (any queue if None)."""
        replies = await self.call(ControlCommand("ping", target=ALL), timeout=window)
        seen: dict[str, ControlReply] = {}
        for r in replies:
            if r.ok and (queue is None or r.info.get("queue") == queue):
                seen.setdefault(r.worker, r)
        return list(seen.values())

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            reply = ControlReply.decode(message.body)
        except Exception as e:
            log.warning("ignored a malformed control reply: %s", e)
            return
        box = self._inbox.get(reply.id)
        if box is not None:
            box.put_nowait(reply)
