"""Fair mode's first hop: each request moves from the shared queue into its client's lane.

A router consumes the request queue (every worker runs one: they compete, as for
requests), reads the client of each message (the body's `client`, else the AMQP app_id,
else "default"), publishes a copy to the client's lane with a publisher confirm, and
only then acks the original: nothing is lost, and a copy doubled by a crash between the
two is answered once by the ledger. It never holds more than its prefetch window, so a
backlog waits in the lanes, in RabbitMQ, whose consumers (every worker's credits) have
it pushed to them.

After RabbitMQ comes back, the robust connection restores its channels one by one: the
router's consumer may be delivering again before the channel it publishes on is back.
A message waits for that channel (bounded: `broker.publisher.open_channel`), and one
that still cannot be routed is requeued only after a pause: a requeue counts toward the
queue's delivery limit, and requeued in a tight loop a message would be dead-lettered
within milliseconds, never having reached a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from broker.acks import Acker
from broker.messages import client_of
from broker.publisher import Requeuer
from broker.topology import Topology
from worker.metrics import MessageEvent, Metrics
from worker.serving.lanes import Lanes

log = logging.getLogger(__name__)

REQUEUE_PAUSE_S = 1.0  # before a message that could not be routed goes back


class Router:
    """Moves messages from the request queue into the lanes of `lanes`."""

    def __init__(
        self,
        source: AbstractQueue,
        publish: AbstractChannel,
        topology: Topology,
        lanes: Lanes,
        metrics: Metrics,
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.publish = publish
        self.topology = topology
        self.lanes = lanes
        self.routed = 0
        self._taken = 0  # messages taken from the source, ever
        self._in_flight = 0  # of those, not yet routed or given back
        self._quiet_since: int | None = None  # `_taken` at the last empty look (burst mode)
        self._tasks: set[asyncio.Task[None]] = set()  # routes started by a look
        self._requeuers: dict[str, Requeuer] = {}
        self._tag: str | None = None
        self.acker = Acker()  # the source's acks, in runs (broker/acks.py)

    async def start(self) -> None:
        """Declare every lane (idempotent: the request queue's arguments), then consume."""
        for queue in self.lanes.queues:
            await self.publish.declare_queue(
                queue, durable=True, arguments=self.topology.queue_arguments()
            )
            self._requeuers[queue] = Requeuer(self.publish, queue)
        self._tag = await self.source.consume(self._route, no_ack=False)

    async def stop(self) -> None:
        if self._tag is not None:
            await self.source.cancel(self._tag)
            self._tag = None
        await self.acker.flush()

    async def drained(self) -> bool:
        """Burst mode: the request queue was found empty twice in a row, with nothing
        taken from it in between and nothing on its way into a lane. A look is a
        basic.get: a message it finds is routed (in a task of its own, as a delivery
        is), and the answer is False. Two looks, because a delivery already pushed to
        the consumer is out of the queue a few event-loop turns before it is counted."""
        if self._tag is None:  # stopped (a drain): it takes nothing more
            return not self._in_flight
        if self._in_flight:
            self._quiet_since = None
            return False
        message = await self.source.get(no_ack=False, fail=False, timeout=10)
        if message is not None:
            self._quiet_since = None
            task = asyncio.create_task(self._route(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return False
        quiet = self._quiet_since == self._taken and not self._in_flight
        self._quiet_since = self._taken
        return quiet

    async def _route(self, message: AbstractIncomingMessage) -> None:
        self._taken += 1
        self._in_flight += 1
        try:
            await self._route_one(message)
        finally:
            self._in_flight -= 1

    async def _route_one(self, message: AbstractIncomingMessage) -> None:
        client = client_of(_body_client(message.body), message.app_id)
        lane = self.lanes.lane_of(client)
        error: Exception | None = None
        for _ in range(2):  # a publish cut by a reconnect is tried once more
            try:
                await self._requeuers[lane.queue].republish(message, {})
                error = None
                break
            except Exception as e:  # not confirmed: the original stays the one copy
                error = e
        if error is not None:
            log.warning("could not route a message to %s (%r); requeued", lane.queue, error)
            await asyncio.sleep(REQUEUE_PAUSE_S)
            with contextlib.suppress(Exception):  # its channel gone: the broker requeues
                await self.acker.nack(message, requeue=True)
            return
        await self.acker.ack(message)
        self.routed += 1
        self.metrics.on_message(MessageEvent.ROUTED)


def _body_client(body: bytes) -> Any:
    """The body's `client` field, if the body is a msgpack map that has one."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:
        return None
    return data.get("client") if isinstance(data, dict) else None
