"""Decode (worker) and encode (producer) a request body under contract v1."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from broker.messages.checks import check_fields, client_name, describe, wire_type
from broker.messages.contract import (
    ACCEPTED_CONTENT_TYPES,
    CONTENT_TYPE,
    DEFAULT_CLIENT,
    DEFAULT_MAX_MESSAGE_BYTES,
    INVALID_REQUEST,
    MAX_ID_LENGTH,
    InvalidRequest,
    RequestMessage,
    pack,
)
from broker.messages.properties import crashes, delivery_count, enqueued_at


def _usable_id(value: str) -> bool:
    """An id the ledger can key on: printable (no NUL or control characters), not too long."""
    return 0 < len(value) <= MAX_ID_LENGTH and value.isprintable()


def decode_request(
    body: bytes,
    *,
    content_type: str | None = None,
    message_id: str | None = None,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    timestamp: dt.datetime | float | None = None,
    expiration: float | str | None = None,
    headers: Mapping[str, Any] | None = None,
    redelivered: bool = False,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    received_at: float | None = None,
    app_id: str | None = None,
) -> RequestMessage:
    """Decode and type-check a request body and its AMQP properties.

    `timestamp` is the AMQP timestamp (a datetime as aio-pika gives it, or unix
    seconds). `expiration` is in seconds as aio-pika decodes it; a string is the raw
    AMQP property, in milliseconds. `received_at` (default: now) stands in for the
    enqueue time when an expiration comes without one. Raises `InvalidRequest`, and
    nothing else, whatever the body holds.
    """
    reply_to = _shortstr(reply_to)
    correlation_id = _shortstr(correlation_id)
    try:
        return _decode(
            body,
            content_type=content_type,
            message_id=message_id,
            correlation_id=correlation_id,
            reply_to=reply_to,
            timestamp=timestamp,
            expiration=expiration,
            headers=headers,
            redelivered=redelivered,
            max_message_bytes=max_message_bytes,
            received_at=received_at,
            app_id=app_id,
        )
    except InvalidRequest:
        raise
    except Exception as e:  # a checker's own failure must cost only this message
        raise InvalidRequest(
            INVALID_REQUEST,
            f"the message could not be decoded: {type(e).__name__}",
            None,
            reply_to,
            correlation_id,
        ) from None


def client_of(body_client: object, app_id: str | None) -> str:
    """The client a request is accounted to: the body's `client`, else the AMQP app_id,
    else "default" (an unusable name counts as absent here; the body's is checked by
    `decode_request`)."""
    for name in (body_client, app_id):
        if isinstance(name, str):
            try:
                return client_name(name, "client")
            except ValueError:
                continue
    return DEFAULT_CLIENT


def _shortstr(value: str | None) -> str | None:
    """An AMQP short string property usable in a reply: valid UTF-8 of at most 255 bytes
    (a malformed one, decoded leniently, is dropped)."""
    if not value:
        return None
    try:
        ok = len(value.encode("utf-8")) <= 255
    except UnicodeEncodeError:
        return None
    return value if ok else None


def _decode(
    body: bytes,
    *,
    content_type: str | None,
    message_id: str | None,
    correlation_id: str | None,
    reply_to: str | None,
    timestamp: dt.datetime | float | None,
    expiration: float | str | None,
    headers: Mapping[str, Any] | None,
    redelivered: bool,
    max_message_bytes: int,
    received_at: float | None,
    app_id: str | None,
) -> RequestMessage:
    given_id = message_id or correlation_id or None
    # An error is recorded under this id; without a usable one, under one of the worker's.
    fallback_id = given_id if given_id is not None and _usable_id(given_id) else None

    def fail(msg: str, request_id: str | None = fallback_id) -> InvalidRequest:
        return InvalidRequest(
            INVALID_REQUEST, msg, request_id, reply_to, correlation_id or request_id
        )

    if len(body) > max_message_bytes:
        raise fail(f"message body is {len(body)} bytes, over the limit of {max_message_bytes}")
    if content_type and content_type.split(";")[0].strip() not in ACCEPTED_CONTENT_TYPES:
        raise fail(f"content_type must be {CONTENT_TYPE!r}, got {content_type!r}")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise fail(f"body is not valid msgpack: {e}") from None
    if not isinstance(data, dict):
        raise fail(f"body must be a msgpack map, got {wire_type(data)}")

    raw_id = data.get("id")
    if raw_id is not None and not isinstance(raw_id, str):
        raise fail(f"id must be a string, got {describe(raw_id)}")
    request_id = raw_id or given_id
    if not request_id:
        raise fail("missing id: set the 'id' field, or the AMQP message_id or correlation_id")
    if len(request_id) > MAX_ID_LENGTH:
        raise fail(f"id is {len(request_id)} characters long, over the limit of {MAX_ID_LENGTH}")
    if not _usable_id(request_id):
        raise fail(f"id must be printable text, got {request_id!r}")
    try:
        fields = check_fields(data)
    except ValueError as e:
        raise fail(str(e), request_id) from None

    if "client" not in fields:
        fields["client"] = client_of(None, app_id)
    enqueued = enqueued_at(timestamp, headers)
    deadline = fields.pop("deadline", None)
    if expiration is not None:
        try:
            ttl = float(expiration) / 1000.0 if isinstance(expiration, str) else float(expiration)
        except ValueError:
            raise fail(f"AMQP expiration must be milliseconds, got {expiration!r}") from None
        base = enqueued if enqueued is not None else (received_at or time.time())
        deadline = base + ttl if deadline is None else min(deadline, base + ttl)

    return RequestMessage(
        id=request_id,
        deadline=deadline,
        reply_to=reply_to,
        correlation_id=correlation_id or request_id,
        enqueued_at=enqueued,
        redelivered=bool(redelivered),
        delivery_count=delivery_count(headers),
        crashes=crashes(headers),
        **fields,
    )


def encode_request(
    *,
    id: str,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    sampling: Mapping[str, Any] | None = None,
    priority: int | None = None,
    deadline: float | None = None,
    stream: bool = False,
    metadata: Mapping[str, Any] | None = None,
    client: str | None = None,
) -> bytes:
    """Encode a request body, checked with the same rules the worker applies.

    Raises `InvalidRequest` (a ValueError) for anything `decode_request` would refuse.
    """
    data: dict[str, Any] = {"id": id}
    if prompt is not None:
        data["prompt"] = prompt
    if messages is not None:
        data["messages"] = [dict(m) if isinstance(m, Mapping) else m for m in messages]
    if prompt_token_ids is not None:
        data["prompt_token_ids"] = list(prompt_token_ids)
    for key, value in (sampling or {}).items():
        if value is not None:
            data[key] = list(value) if isinstance(value, tuple) else value
    if priority is not None:
        data["priority"] = priority
    if client is not None:
        data["client"] = client
    if deadline is not None:
        data["deadline"] = deadline
    if metadata is not None:
        data["metadata"] = dict(metadata) if isinstance(metadata, Mapping) else metadata
    if stream:
        data["stream"] = True
    body = pack(data)
    decode_request(body, max_message_bytes=max(len(body), DEFAULT_MAX_MESSAGE_BYTES))
    return body
