"""broker.cork: writes of one event-loop turn leave in one socket write, bytes unchanged."""

from __future__ import annotations

import asyncio

from broker.cork import cork


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


async def test_one_turn_of_writes_is_one_socket_write_in_order() -> None:
    _reader, writer, server, received = await _pair()
    sends: list[bytes] = []
    send = writer.transport.write

    def counting(data: bytes | bytearray | memoryview) -> None:
        sends.append(bytes(data))
        send(data)

    writer.transport.write = counting  # type: ignore[method-assign]
    cork(writer)
    for i in range(50):
        writer.write(b"frame-%d;" % i)
    assert sends == []  # held until the turn ends
    await asyncio.sleep(0)
    assert len(sends) == 1
    writer.write(b"next-turn;")
    await asyncio.sleep(0)
    assert len(sends) == 2
    writer.write(b"last;")  # written and closed in the same turn: still sent
    writer.close()
    await server.done.wait()  # type: ignore[attr-defined]
    server.close()
    expected = b"".join(b"frame-%d;" % i for i in range(50)) + b"next-turn;last;"
    assert b"".join(received) == expected
    assert sends[-1] == b"last;"
