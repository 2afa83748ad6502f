"""A minimal AMQP 0-9-1 publisher speaking raw frames, to send what no client library would:
properties that are not valid UTF-8, timestamps past the year 9999, unknown delivery modes.

It logs in, opens one channel, publishes, and waits for a publisher confirm, so the test
knows the broker has the message. Built on pamqp's frame (un)marshalling; the malformed
bytes are written over a marshalled frame (`Patch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from pamqp import body, commands, exceptions, frame, header
from pamqp.base import Frame

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
# A timestamp marshalled as a placeholder, and the raw value written over it: 2**62 s
# (pamqp reads values above 2**32 as milliseconds: still past the year 9999).
PLACEHOLDER_TIME = dt.datetime(2001, 9, 9, 1, 46, 40, tzinfo=dt.UTC)  # 1e9
HUGE_TIME = struct.pack(">Q", 2**62)


@dataclass(frozen=True)
class Patch:
    """Replace `old` (which must occur exactly once in the content header) by `new`."""

    old: bytes
    new: bytes


class RawPublisher:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._buf = b""
        self._delivery_tag = 0

    @classmethod
    async def connect(cls, url: str) -> RawPublisher:
        u = urlparse(url)
        reader, writer = await asyncio.open_connection(u.hostname or "127.0.0.1", u.port or 5672)
        self = cls(reader, writer)
        writer.write(PROTOCOL_HEADER)
        await self._expect(commands.Connection.Start)
        login = f"\0{unquote(u.username or 'guest')}\0{unquote(u.password or 'guest')}"
        self._send(0, commands.Connection.StartOk(client_properties={}, response=login))
        tune = await self._expect(commands.Connection.Tune)
        self._send(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        vhost = unquote(u.path[1:]) if u.path and u.path != "/" else "/"
        self._send(0, commands.Connection.Open(virtual_host=vhost))
        await self._expect(commands.Connection.OpenOk)
        self._send(1, commands.Channel.Open())
        await self._expect(commands.Channel.OpenOk)
        self._send(1, commands.Confirm.Select())
        await self._expect(commands.Confirm.SelectOk)
        return self

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        payload: bytes,
        properties: dict[str, Any],
        patches: tuple[Patch, ...] = (),
    ) -> None:
        """Publish `payload` with `properties`, the content header's bytes patched; returns
        once the broker confirms it (raises if it refuses)."""
        props = commands.Basic.Properties(**properties)
        content = frame.marshal(header.ContentHeader(0, len(payload), props), 1)
        for p in patches:
            assert content.count(p.old) == 1, f"{p.old!r} is not unique in the header"
            assert len(p.old) == len(p.new), "a patch keeps the frame's length"
            content = content.replace(p.old, p.new)
        self._send(1, commands.Basic.Publish(exchange=exchange, routing_key=routing_key))
        self.writer.write(content + frame.marshal(body.ContentBody(payload), 1))
        self._delivery_tag += 1
        ack = await self._expect((commands.Basic.Ack, commands.Basic.Nack))
        if isinstance(ack, commands.Basic.Nack):
            raise RuntimeError("the broker refused the message")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._send(0, commands.Connection.Close())
            await asyncio.wait_for(self._expect(commands.Connection.CloseOk), 5)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    def _send(self, channel: int, value: Frame) -> None:
        self.writer.write(frame.marshal(value, channel))

    async def _expect(self, kind: Any) -> Any:
        while True:
            _, value = await self._read()
            if isinstance(value, kind):
                return value
            if isinstance(value, (commands.Connection.Close, commands.Channel.Close)):
                raise RuntimeError(f"the broker closed: {value.reply_code} {value.reply_text}")

    async def _read(self) -> tuple[int, Any]:
        while True:
            try:
                consumed, channel, value = frame.unmarshal(self._buf)
            except exceptions.UnmarshalingException:
                chunk = await asyncio.wait_for(self.reader.read(65536), 30)
                if not chunk:
                    raise ConnectionError("the broker closed the connection") from None
                self._buf += chunk
                continue
            self._buf = self._buf[consumed:]
            return channel, value
