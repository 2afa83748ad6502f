"""Decoding the AMQP properties a producer got wrong, so that one bad message costs only itself.

The AMQP client decodes every frame before kvflow sees the message, and pamqp's decoder
raises on a short string that is not UTF-8, a table key that is not UTF-8, or a
timestamp past the year 9999 (RabbitMQ passes all of these through). A raise there
ends the connection's frame reader: the connection closes, and every delivery on it
(other requests in flight, the control plane's queue) is requeued.

`install()` makes those decoders lenient: a malformed string decodes with surrogate
escapes (which kvflow's contract checks then refuse: the message is rejected alone),
an out-of-range timestamp decodes as absent. It changes
pamqp's decoder tables for the whole process, once; every kvflow connection
(`broker.connection.connect`) calls it first.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

from pamqp import common, decode

_INSTALLED = "_kvflow_lenient"


def short_str(value: bytes) -> tuple[int, str]:
    """pamqp's short string, with bytes that are not UTF-8 kept as surrogate escapes."""
    try:
        length = common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack short string value") from err
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def timestamp(value: bytes) -> tuple[int, datetime.datetime | None]:
    """pamqp's timestamp; one that no datetime can hold decodes as None."""
    try:
        return _strict_timestamp(value)
    except (ValueError, OverflowError, OSError):
        if len(value) < 8:
            raise ValueError("Could not unpack timestamp value") from None
        return 8, None


def field_table(value: bytes) -> tuple[int, common.FieldTable]:
    """pamqp's field table, with keys that are not UTF-8 kept as surrogate escapes."""
    try:
        length = common.Struct.integer.unpack(value[0:4])[0]
        offset, end = 4, 4 + length
        if end > len(value):
            raise ValueError("Field table length exceeds available data")
        data: dict[str, Any] = {}
        while offset < end:
            key_length = common.Struct.byte.unpack_from(value, offset)[0]
            offset += 1
            if offset + key_length > end:
                raise ValueError("Field table key length exceeds data")
            key = value[offset : offset + key_length].decode("utf-8", "surrogateescape")
            offset += key_length
            consumed, result = decode.embedded_value(value[offset:])
            offset += consumed
            data[key] = result
        return end, data
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack data") from err


_strict_timestamp = decode.timestamp


def install() -> None:
    """Make this process's AMQP frame decoding lenient (idempotent)."""
    if getattr(decode, _INSTALLED, False):
        return
    for name, fn in (
        ("short_str", short_str),
        ("timestamp", timestamp),
        ("field_table", field_table),
    ):
        setattr(decode, name, fn)
    decode.METHODS["shortstr"] = short_str
    decode.METHODS["timestamp"] = timestamp
    decode.METHODS["table"] = field_table
    decode.TABLE_MAPPING[b"T"] = timestamp
    decode.TABLE_MAPPING[b"F"] = field_table
    setattr(decode, _INSTALLED, True)
