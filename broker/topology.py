"""Where kvflow's messages live on the broker, declared idempotently, and how to count them.

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

import asyncio
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
DEFAULT_QUEUE = "kvflow.requests"
DEFAULT_EXCHANGE = "kvflow"
DEFAULT_CONTROL_EXCHANGE = "kvflow.control"


def amqp_url_from_env(url: str | None = None) -> str:
    """`url`, else $KVFLOW_AMQP_URL, else the local guest account."""
    return url or os.environ.get("KVFLOW_AMQP_URL") or DEFAULT_URL


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``, safe to print or log."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable AMQP URL>"
    if not password:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def redact_text(text: str, url: str) -> str:
    """`text` with every occurrence of `url` and of its password masked."""
    text = text.replace(url, redact_url(url))
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(password, "***")
        text = text.replace(urllib.parse.quote(password, safe=""), "***")
    return text


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


async def queue_counts(
    url: str | None, queue: str, *, management_url: str | None = None
) -> tuple[int, int]:
    """(ready, unacknowledged) message counts of `queue`; LookupError if it is missing.

    `ready` is exact: a passive declare's message_count, which counts ready messages
    only (so it reads 0 while a queue's only message is unacked; that is the "passive
    declare lies" of the field notes). `unacknowledged` has no AMQP query: it comes from
    `rabbitmqctl` when that is installed and `url` names this machine, otherwise from
    the management HTTP API (`management_url`, default http://<host>:15672). Both
    report what a quorum queue publishes on its tick, so on 3.10 that figure can lag
    by about 5 s (measured: a new message showed in rabbitmqctl after ~5 s).
    """
    url = amqp_url_from_env(url)
    ready = await _ready_count(url, queue)
    parts = urllib.parse.urlsplit(url)
    vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    local = (parts.hostname or "localhost") in ("localhost", "127.0.0.1", "::1")
    ctl_error = None
    if management_url is None and local and shutil.which("rabbitmqctl"):
        try:
            return ready, (await _counts_rabbitmqctl(vhost, queue))[1]
        except RuntimeError as e:
            ctl_error = e
    base = management_url or f"http://{parts.hostname or 'localhost'}:15672"
    user = urllib.parse.unquote(parts.username or "guest")
    password = urllib.parse.unquote(parts.password or "guest")
    try:
        counts = await asyncio.to_thread(_counts_http, base, user, password, vhost, queue)
    except RuntimeError as e:
        if ctl_error is None:
            raise
        raise RuntimeError(f"{ctl_error}; and {e}") from None
    return ready, counts[1]


async def _ready_count(url: str, queue: str) -> int:
    try:
        connection = await aio_pika.connect(url, timeout=10)
    except (OSError, asyncio.TimeoutError, aiormq.exceptions.AMQPError) as e:
        reason = redact_text(str(e) or type(e).__name__, url)
        raise ConnectionError(f"cannot reach RabbitMQ at {redact_url(url)}: {reason}") from None
    try:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise LookupError(f"queue {queue!r} not found") from None
        count = declared.declaration_result.message_count
        return int(count or 0)
    finally:
        await connection.close()


async def _counts_rabbitmqctl(vhost: str, queue: str) -> tuple[int, int]:
    args = ["-q", "list_queues", "-p", vhost, "name", "messages_ready"]
    args += ["messages_unacknowledged", "--formatter", "json"]
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(
            f"rabbitmqctl list_queues failed ({proc.returncode}): {err.decode().strip()}"
        )
    for row in json.loads(out.decode() or "[]"):
        if row.get("name") == queue:
            return int(row.get("messages_ready") or 0), int(row.get("messages_unacknowledged") or 0)
    raise LookupError(f"queue {queue!r} not found in vhost {vhost!r}")


def _counts_http(base: str, user: str, password: str, vhost: str, queue: str) -> tuple[int, int]:
    path = f"/api/queues/{urllib.parse.quote(vhost, safe='')}/{urllib.parse.quote(queue, safe='')}"
    req = urllib.request.Request(base.rstrip("/") + path)
    token = b64encode(f"{user}:{password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise LookupError(f"queue {queue!r} not found in vhost {vhost!r}") from None
        raise RuntimeError(f"management API at {base} answered HTTP {e.code}") from None
    except urllib.error.URLError as e:
        raise RuntimeError(
            f"cannot count messages: no management API at {base} ({e.reason})"
        ) from None
    return int(data.get("messages_ready") or 0), int(data.get("messages_unacknowledged") or 0)
