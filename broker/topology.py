"""Where kvflow's messages live on the broker, declared idempotently.

Layout (all durable):

- exchange ``kvflow`` (direct): producers publish requests here with routing key =
  the request queue's name.
- queue ``<queue>`` (quorum), bound to ``kvflow`` with routing key = its name. A
  message rejected without requeue, or delivered more than ``delivery_limit`` times,
  is dead-lettered at-least-once through the default exchange into ``<queue>.dead``.
- queue ``<queue>.dead`` (classic): the parking lot for poison and refused messages.
- exchange ``kvflow.control`` (fanout): control-plane broadcasts to every worker.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from broker.redact import redact_text, redact_url

__all__ = [
    "DEFAULT_CONTROL_EXCHANGE",
    "DEFAULT_EXCHANGE",
    "DEFAULT_QUEUE",
    "DEFAULT_URL",
    "DeclaredQueues",
    "Topology",
    "TopologyMismatch",
    "amqp_url_from_env",
    "declare",
    "declare_request_path",
    "redact_text",  # moved to broker.redact; still importable from here
    "redact_url",
]

DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
DEFAULT_QUEUE = "kvflow.requests"
DEFAULT_EXCHANGE = "kvflow"
DEFAULT_CONTROL_EXCHANGE = "kvflow.control"


def amqp_url_from_env(url: str | None = None) -> str:
    """`url`, else $KVFLOW_AMQP_URL, else the local guest account."""
    return url or os.environ.get("KVFLOW_AMQP_URL") or DEFAULT_URL


@dataclass(frozen=True)
class Topology:
    """Names and limits of kvflow's exchanges and queues.

    `queue` defaults to $KVFLOW_QUEUE and `exchange` to $KVFLOW_EXCHANGE, read when
    the object is built. `delivery_limit` is how many times a message may be
    redelivered (requeued or its consumer lost) before it is dead-lettered.
    """

    queue: str = field(default_factory=lambda: os.environ.get("KVFLOW_QUEUE") or DEFAULT_QUEUE)
    exchange: str = field(
        default_factory=lambda: os.environ.get("KVFLOW_EXCHANGE") or DEFAULT_EXCHANGE
    )
    control_exchange: str = DEFAULT_CONTROL_EXCHANGE
    delivery_limit: int = 5

    def __post_init__(self) -> None:
        for what, name in (("queue", self.queue), ("exchange", self.exchange)):
            if not name or len(name.encode()) > 250:
                raise ValueError(f"{what} name must be 1 to 250 bytes long, got {name!r}")
            if name.startswith("amq."):
                raise ValueError(f"{what} name {name!r}: names starting with 'amq.' are reserved")
        if isinstance(self.delivery_limit, bool) or not isinstance(self.delivery_limit, int):
            raise ValueError(f"delivery_limit must be an integer, got {self.delivery_limit!r}")
        if self.delivery_limit < 0:
            raise ValueError(f"delivery_limit must be >= 0, got {self.delivery_limit}")

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.queue}.dead"

    def queue_arguments(self) -> dict[str, Any]:
        """Arguments of the request queue (see the module docstring for the why)."""
        return {
            # Quorum: replicated, and it counts deliveries, so a message that keeps
            # crashing workers stops after delivery_limit tries. 3.10 has no default limit.
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            # Dead letters go through the default exchange straight to <queue>.dead.
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.dead_letter_queue,
            # At-most-once is 3.10's default: a dead letter the target refused would be
            # lost. At-least-once keeps it until <queue>.dead confirms, and requires
            # reject-publish overflow.
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }

    def dead_letter_arguments(self) -> dict[str, Any]:
        """Arguments of the dead-letter queue: a plain durable classic queue.

        Classic, not quorum: it is a parking lot read by people and replay tools, not a
        work queue, so a delivery limit (the reason to pick quorum above) buys nothing;
        dead letters show up in a classic queue at once, while into a quorum queue they
        took seconds on 3.10 (NOTES.md). The price is no replication in a cluster.
        """
        return {"x-queue-type": "classic"}


@dataclass(frozen=True)
class DeclaredQueues:
    """What `declare` made sure exists, as aio-pika objects on the given channel."""

    exchange: AbstractExchange
    queue: AbstractQueue
    dead_letter: AbstractQueue
    control: AbstractExchange


class TopologyMismatch(RuntimeError):
    """An exchange or queue already exists with different settings than kvflow's."""


async def declare(channel: AbstractChannel, topo: Topology) -> DeclaredQueues:
    """Declare all of kvflow's exchanges and queues; safe to call any number of times.

    Raises `TopologyMismatch` naming the object and the differing argument when one
    exists with other settings; the broker closes `channel` in that case.
    """
    exchange, queue, dead = await declare_request_path(channel, topo)
    control = await _checked(
        "exchange",
        topo.control_exchange,
        channel.declare_exchange(topo.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True),
    )
    return DeclaredQueues(exchange=exchange, queue=queue, dead_letter=dead, control=control)


async def declare_request_path(
    channel: AbstractChannel, topo: Topology
) -> tuple[AbstractExchange, AbstractQueue, AbstractQueue]:
    """Declare what a producer needs: (request exchange, request queue, dead-letter queue).

    Declaring the queue, not only the exchange, keeps requests published before any
    worker started from being dropped as unroutable. Errors as for `declare`.
    """
    exchange = await _checked(
        "exchange",
        topo.exchange,
        channel.declare_exchange(topo.exchange, aio_pika.ExchangeType.DIRECT, durable=True),
    )
    dead = await _checked(
        "queue",
        topo.dead_letter_queue,
        channel.declare_queue(
            topo.dead_letter_queue, durable=True, arguments=topo.dead_letter_arguments()
        ),
    )
    queue = await _checked(
        "queue",
        topo.queue,
        channel.declare_queue(topo.queue, durable=True, arguments=topo.queue_arguments()),
    )
    await queue.bind(exchange, routing_key=topo.queue)
    return exchange, queue, dead


_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)' .*received (.+) but current is (.+)$")


async def _checked(kind: str, name: str, declaring: Any) -> Any:
    try:
        return await declaring
    except aiormq.exceptions.ChannelPreconditionFailed as e:
        text = str(e.args[0]) if e.args else str(e)
        found = _INEQUIVALENT.search(text)
        detail = (
            f"argument {found[1]!r} is {found[3]} on the broker but kvflow wants {found[2]}"
            if found
            else text
        )
        env = "KVFLOW_QUEUE" if kind == "queue" else "KVFLOW_EXCHANGE"
        raise TopologyMismatch(
            f"{kind} {name!r} already exists with different settings: {detail}. Delete it "
            f"or pick another name ({env}); broker said: {text}"
        ) from None
