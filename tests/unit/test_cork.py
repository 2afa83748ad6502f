"""broker.cork: writes of one event-loop turn leave in one socket write, bytes unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from broker.cork import cork
from broker.turns import MAX_TURNS


async def _turns_until(done: Callable[[], bool]) -> int:
    """Yield to the loop until `done()`; returns how many turns that took."""
    turns = 0
    while not done():
        await asyncio.sleep(0)
        turns += 1
    return turns


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server, list[bytes]]:
    received: list[bytes] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            received.append(chunk)
        done.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    server.done = done  # type: ignore[attr-defined]
    return reader, writer, server, received


def _corked_counting(writer: asyncio.StreamWriter) -> list[bytes]:
    """Cork `writer`; the list returned receives each socket write the cork makes."""
    sends: list[bytes] = []
    send = writer.transport.write

    def counting(data: bytes | bytearray | memoryview) -> None:
        sends.append(bytes(data))
        send(data)

    writer.transport.write = counting  # type: ignore[method-assign]
    cork(writer)
    return sends


async def test_one_turn_of_writes_is_one_socket_write_in_order() -> None:
    _reader, writer, server, received = await _pair()
    sends = _corked_counting(writer)
    for i in range(50):
        writer.write(b"frame-%d;" % i)
    assert sends == []  # held until the turn ends
    assert await _turns_until(lambda: bool(sends)) <= MAX_TURNS
    assert len(sends) == 1
    writer.write(b"next-turn;")
    assert await _turns_until(lambda: len(sends) == 2) <= MAX_TURNS
    writer.write(b"last;")  # written and closed in the same turn: still sent
    writer.close()
    await server.done.wait()  # type: ignore[attr-defined]
    server.close()
    expected = b"".join(b"frame-%d;" % i for i in range(50)) + b"next-turn;last;"
    assert b"".join(received) == expected
    assert sends[-1] == b"last;"


async def test_writes_wait_for_a_busy_loop_a_few_turns_at_most() -> None:
    _reader, writer, server, _received = await _pair()
    sends = _corked_counting(writer)
    writer.write(b"first;")
    # Other work keeps the loop busy and writes meanwhile: it joins the same write.
    for i in range(MAX_TURNS - 2):
        await asyncio.sleep(0)
        writer.write(b"more-%d;" % i)
    assert sends == []

    async def spin() -> None:  # always a callback ready
        while True:
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin())
    try:
        assert await _turns_until(lambda: bool(sends)) <= MAX_TURNS
    finally:
        spinner.cancel()
    assert sends == [b"first;" + b"".join(b"more-%d;" % i for i in range(MAX_TURNS - 2))]
    writer.close()
    await server.done.wait()  # type: ignore[attr-defined]
    server.close()
