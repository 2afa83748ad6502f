"""Coalescing a connection's outgoing AMQP frames: one socket write per event-loop turn.

The AMQP client writes every frame it sends (an ack, a publish's method, header and
body, a heartbeat) to the socket as soon as it is queued, and a socket write is a
system call. A worker settling a burst of requests acks and answers each of them: two
writes per request, about a fifth of its event loop's time at a few hundred requests
per second (measured with ops/bench/pipeline.py). `install()` gives every connection
the client opens a socket whose writes are held until the current turn of the event
loop ends and then sent together; the bytes and their order are the same, only the
system calls are fewer. Under load a burst's work spreads over a few turns (a confirm
wakes its caller a turn later, which then acks), so while other callbacks are ready the
write waits for them (`broker.turns.EndOfTurn`): a loop with nothing else to do writes
at once, and a busy one waits for a fraction of a millisecond at most.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiormq.connection import TCPTransportFactory, TLSTransportFactory
from yarl import URL

from broker.turns import EndOfTurn


class _Cork:
    """Buffers a transport's writes until the end of the event-loop turn."""

    def __init__(self, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._write_now = transport.write
        self._close_now = transport.close
        self._pending: list[bytes] = []
        self._end = EndOfTurn(loop, self.flush)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(bytes(data))
        self._end.arm()

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._write_now(data)

    def close(self) -> None:
        # A Connection.Close frame written just before the socket closes still goes out.
        self.flush()
        self._close_now()


def cork(writer: asyncio.StreamWriter) -> asyncio.StreamWriter:
    """Make `writer`'s transport coalesce writes per event-loop turn; returns `writer`."""
    transport = writer.transport
    c = _Cork(transport, asyncio.get_running_loop())
    # Instance attributes: this transport only, the class stays as it is.
    transport.write = c.write  # type: ignore[method-assign]
    transport.close = c.close  # type: ignore[method-assign]
    return writer


_INSTALLED = "_kvflow_corked"


def install() -> None:
    """Make every AMQP connection this process opens coalesce its writes (idempotent).

    aio-pika passes connection keywords to the client as URL query values, so a
    transport factory cannot be handed to one connection; the client's TCP and TLS
    factories are wrapped instead, once, for the whole process.
    """
    for factory in (TCPTransportFactory, TLSTransportFactory):
        if getattr(factory, _INSTALLED, False):
            continue
        create = factory.create

        async def corked(
            self: Any, url: URL, _create: Any = create, **kwargs: Any
        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await _create(self, url, **kwargs)
            return reader, cork(writer)

        factory.create = corked  # type: ignore[method-assign]
        setattr(factory, _INSTALLED, True)
