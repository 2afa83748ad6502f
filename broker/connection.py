"""Opening a connection to RabbitMQ, with one error for every way that can fail."""

from __future__ import annotations

from aio_pika import connect as plain_connect
from aio_pika import connect_robust
from aio_pika.abc import AbstractConnection

from broker import cork, lenient
from broker.errors import BrokerUnavailable
from broker.redact import redact_text, redact_url


async def connect(
    url: str, *, robust: bool = False, timeout: float = 10.0, name: str = "kvflow"
) -> AbstractConnection:
    """A connection to `url` (robust: reconnects by itself), named `name` in the broker's
    management views; BrokerUnavailable, password masked, if it cannot be made. Frames
    are decoded leniently (`broker.lenient`): one malformed message never closes it; the
    frames sent in one event-loop turn go out in one socket write (`broker.cork`)."""
    lenient.install()
    cork.install()
    opener = connect_robust if robust else plain_connect
    try:
        return await opener(
            url,
            timeout=timeout,
            client_properties={"connection_name": name},
        )
    except Exception as e:  # refused, timed out, bad login, bad URL: all read the same
        reason = redact_text(str(e) or type(e).__name__, url)
        raise BrokerUnavailable(f"cannot reach RabbitMQ at {redact_url(url)}: {reason}") from None
