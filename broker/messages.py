"""Message contract v1: the msgpack bodies that travel through RabbitMQ.

Request (published to exchange ``kvflow``, routing key = the request queue's name;
content_type ``application/msgpack``; a msgpack map):

``id`` (string, required)
    The idempotency key. When absent from the body it is taken from the AMQP
    ``message_id``, then from ``correlation_id``. At most 255 characters.
exactly one of ``prompt`` / ``messages`` / ``prompt_token_ids``
    ``prompt``: a string. ``messages``: a non-empty list of ``{"role", "content"}``
    maps of strings, rendered with the model's chat template. ``prompt_token_ids``:
    a list of integers.
sampling (all optional; see `SAMPLING_FIELDS`)
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
    ``stop`` (a list of strings, or one string), ``stop_token_ids``, ``ignore_eos``,
    ``min_tokens``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``logprobs``. Only their types are checked here; the worker
    checks their ranges and answers ``invalid_request``.
``priority`` (int, lower is served first), ``deadline`` (unix seconds)
    The AMQP ``expiration`` property is honoured too: the deadline becomes the
    earlier of ``deadline`` and enqueue time + expiration.
``stream`` (bool)
    Send ``delta`` replies while generating.
``metadata`` (map with string keys, JSON-compatible values, at most 4 KiB encoded)
    Echoed in the result and stored in the ledger.

A field whose value is nil counts as absent. Unknown fields are refused.

AMQP properties: ``reply_to`` (optional; without it the result goes only to the
ledger), ``correlation_id`` (echoed on every reply; defaults to the id),
``timestamp`` (the enqueue time, 1 s resolution) and the header ``x-enqueued-at``
(unix seconds with sub-second precision, as a string, an integer or a 64-bit float;
kvflow's client writes a string because pamqp encodes a Python float header as a
32-bit float, which is ~100 s coarse at today's epoch). Quorum queues add the header
``x-delivery-count``.

Replies (published to ``reply_to`` through the default exchange, msgpack maps,
``correlation_id`` set, in order per request):

- ``{"id", "type": "delta", "index", "text", "token_ids"}`` while generating, when
  ``stream`` is true; ``index`` counts deltas from 0.
- ``{"id", "type": "result", "text", "token_ids", "finish_reason", "usage":
  {"prompt_tokens", "completion_tokens"}, "timing": {...}, "worker", "metadata"}``
  exactly once at the end; ``timing`` holds `TIMING_FIELDS`.
- ``{"id", "type": "error", "error": {"code", "message"}}`` instead of a result when
  the request cannot be served; ``code`` is one of `ERROR_CODES`.

Deltas and results carry an extra ``logprobs`` entry only when logprobs were asked for.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

CONTENT_TYPE = "application/msgpack"
ACCEPTED_CONTENT_TYPES = frozenset({CONTENT_TYPE, "application/x-msgpack"})
ENQUEUED_AT_HEADER = "x-enqueued-at"
DELIVERY_COUNT_HEADER = "x-delivery-count"

MAX_ID_LENGTH = 255
MAX_METADATA_BYTES = 4096
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

INVALID_REQUEST = "invalid_request"
PROMPT_TOO_LONG = "prompt_too_long"
EXPIRED = "expired"
CANCELLED = "cancelled"
INTERNAL = "internal"
ERROR_CODES = frozenset({INVALID_REQUEST, PROMPT_TOO_LONG, EXPIRED, CANCELLED, INTERNAL})

REPLY_TYPES = frozenset({"delta", "result", "error"})

TIMING_FIELDS = (
    "enqueued_at",
    "received_at",
    "admitted_at",
    "first_token_at",
    "finished_at",
    "queue_s",
    "ttft_s",
    "prefill_s",
    "decode_s",
    "e2e_s",
    "itl_mean_s",
    "itl_p50_s",
    "itl_p99_s",
    "preemptions",
)

# Wire-level kinds of the sampling fields; the names match worker.request.SamplingParams.
_INT, _NUMBER, _BOOL, _STOP, _INT_LIST = "int", "number", "bool", "stop", "int_list"
SAMPLING_FIELDS: Mapping[str, str] = {
    "max_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INT,
    "min_p": _NUMBER,
    "seed": _INT,
    "stop": _STOP,
    "stop_token_ids": _INT_LIST,
    "ignore_eos": _BOOL,
    "min_tokens": _INT,
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "logprobs": _INT,
}
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
REQUEST_FIELDS = frozenset(
    {"id", *PROMPT_FIELDS, *SAMPLING_FIELDS, "priority", "deadline", "stream", "metadata"}
)


class InvalidRequest(ValueError):
    """A request body that breaks contract v1; the worker answers it with an error reply.

    `request_id`, `reply_to` and `correlation_id` are whatever could be recovered, so
    the caller can still address the error reply (all may be None).
    """

    def __init__(
        self,
        code: str,
        message: str,
        request_id: str | None = None,
        reply_to: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply_to = reply_to
        self.correlation_id = correlation_id


@dataclass(frozen=True)
class RequestMessage:
    """One decoded request: exactly one of prompt, messages or prompt_token_ids is set.

    `sampling` holds only the sampling fields that were sent, type-checked, with number
    fields as floats and `stop` as a list, ready for ``SamplingParams(**sampling)``.
    `deadline` already folds in the AMQP expiration. `enqueued_at` is unix seconds
    (None when the producer sent neither a timestamp nor ``x-enqueued-at``).
    `delivery_count` is the quorum queue's count of earlier failed deliveries.
    """

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    deadline: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    enqueued_at: float | None = None
    redelivered: bool = False
    delivery_count: int | None = None


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
) -> RequestMessage:
    """Decode and type-check a request body and its AMQP properties.

    `timestamp` is the AMQP timestamp (a datetime as aio-pika gives it, or unix
    seconds). `expiration` is in seconds as aio-pika decodes it; a string is the raw
    AMQP property, in milliseconds. `received_at` (default: now) stands in for the
    enqueue time when an expiration comes without one. Raises `InvalidRequest`.
    """
    reply_to = reply_to or None
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
        raise fail(f"body must be a msgpack map, got {_wire_type(data)}")

    raw_id = data.get("id")
    if raw_id is not None and not isinstance(raw_id, str):
        raise fail(f"id must be a string, got {_describe(raw_id)}")
    request_id = raw_id or given_id
    if not request_id:
        raise fail("missing id: set the 'id' field, or the AMQP message_id or correlation_id")
    if len(request_id) > MAX_ID_LENGTH:
        raise fail(f"id is {len(request_id)} characters long, over the limit of {MAX_ID_LENGTH}")
    if not _usable_id(request_id):
        raise fail(f"id must be printable text, got {request_id!r}")
    try:
        fields = _check_fields(data)
    except ValueError as e:
        raise fail(str(e), request_id) from None

    enqueued_at = _enqueued_at(timestamp, headers)
    deadline = fields.pop("deadline", None)
    if expiration is not None:
        try:
            ttl = float(expiration) / 1000.0 if isinstance(expiration, str) else float(expiration)
        except ValueError:
            raise fail(f"AMQP expiration must be milliseconds, got {expiration!r}") from None
        base = enqueued_at if enqueued_at is not None else (received_at or time.time())
        deadline = base + ttl if deadline is None else min(deadline, base + ttl)

    count = (headers or {}).get(DELIVERY_COUNT_HEADER)
    return RequestMessage(
        id=request_id,
        deadline=deadline,
        reply_to=reply_to,
        correlation_id=correlation_id or request_id,
        enqueued_at=enqueued_at,
        redelivered=bool(redelivered),
        delivery_count=count if isinstance(count, int) and not isinstance(count, bool) else None,
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
    if deadline is not None:
        data["deadline"] = deadline
    if metadata is not None:
        data["metadata"] = dict(metadata) if isinstance(metadata, Mapping) else metadata
    if stream:
        data["stream"] = True
    body = _pack(data)
    decode_request(body, max_message_bytes=max(len(body), DEFAULT_MAX_MESSAGE_BYTES))
    return body


def encode_delta(
    id: str, index: int, text: str, token_ids: Sequence[int], logprobs: Any = None
) -> bytes:
    """A ``delta`` reply: the text and tokens generated since the previous delta."""
    reply: dict[str, Any] = {
        "id": id,
        "type": "delta",
        "index": index,
        "text": text,
        "token_ids": list(token_ids),
    }
    if logprobs is not None:
        reply["logprobs"] = logprobs
    return _pack(reply)


def encode_result(
    id: str,
    *,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    timing: Mapping[str, Any],
    worker: str,
    metadata: Mapping[str, Any] | None = None,
    logprobs: Any = None,
) -> bytes:
    """The ``result`` reply, sent exactly once per served request.

    `timing` should hold `TIMING_FIELDS` (unix seconds for ``*_at``, seconds for
    ``*_s``, a count for ``preemptions``); it is sent as given.
    """
    reply: dict[str, Any] = {
        "id": id,
        "type": "result",
        "text": text,
        "token_ids": list(token_ids),
        "finish_reason": str(finish_reason),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        "timing": dict(timing),
        "worker": worker,
        "metadata": dict(metadata) if metadata is not None else None,
    }
    if logprobs is not None:
        reply["logprobs"] = logprobs
    return _pack(reply)


def encode_error(id: str | None, code: str, message: str) -> bytes:
    """An ``error`` reply, sent instead of a result; `code` must be in `ERROR_CODES`."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}; use one of {sorted(ERROR_CODES)}")
    return _pack({"id": id, "type": "error", "error": {"code": code, "message": message}})


def decode_reply(body: bytes) -> dict[str, Any]:
    """Decode a reply; raises ValueError unless it is a map with a known ``type``."""
    try:
        reply = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"reply is not valid msgpack: {e}") from None
    if not isinstance(reply, dict):
        raise ValueError(f"reply must be a msgpack map, got {_wire_type(reply)}")
    if reply.get("type") not in REPLY_TYPES:
        raise ValueError(
            f"reply type must be one of {sorted(REPLY_TYPES)}, got {reply.get('type')!r}"
        )
    return reply


# ---------------------------------------------------------------------------- checks


def _check_fields(data: dict[Any, Any]) -> dict[str, Any]:
    """Type-check everything but the id; returns RequestMessage keyword arguments."""
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"field names must be strings, got {', '.join(map(repr, bad_keys))}")
    unknown = sorted(k for k in data if k not in REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    given = {k: v for k, v in data.items() if v is not None and k != "id"}

    forms = [k for k in PROMPT_FIELDS if k in given]
    if not forms:
        raise ValueError("no prompt: send one of 'prompt', 'messages' or 'prompt_token_ids'")
    if len(forms) > 1:
        raise ValueError(
            f"send exactly one of 'prompt', 'messages' or 'prompt_token_ids', got {' and '.join(forms)}"
        )
    out: dict[str, Any] = {}
    if "prompt" in given:
        out["prompt"] = _expect(given["prompt"], str, "prompt", "a string")
    if "messages" in given:
        out["messages"] = _messages(given["messages"])
    if "prompt_token_ids" in given:
        out["prompt_token_ids"] = _int_list(given["prompt_token_ids"], "prompt_token_ids")

    sampling: dict[str, Any] = {}
    for name, kind in SAMPLING_FIELDS.items():
        if name in given:
            sampling[name] = _sampling_value(name, kind, given[name])
    out["sampling"] = sampling
    if "priority" in given:
        out["priority"] = _integer(given["priority"], "priority")
    if "deadline" in given:
        out["deadline"] = _number(given["deadline"], "deadline")
    if "stream" in given:
        out["stream"] = _expect(given["stream"], bool, "stream", "a boolean")
    if "metadata" in given:
        out["metadata"] = _metadata(given["metadata"])
    return out


def _sampling_value(name: str, kind: str, value: Any) -> Any:
    if kind == _INT:
        return _integer(value, name)
    if kind == _NUMBER:
        return _number(value, name)
    if kind == _BOOL:
        return _expect(value, bool, name, "a boolean")
    if kind == _INT_LIST:
        return _int_list(value, name)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"stop must be a string or a list of strings, got {_describe(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise ValueError(f"stop[{i}] must be a string, got {_describe(s)}")
    return list(value)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"messages must be a non-empty list of {{role, content}} maps, got {_describe(value)}"
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(
                f"messages[{i}] must be a map with role and content, got {_describe(m)}"
            )
        extra = sorted(str(k) for k in m if k not in ("role", "content"))
        if extra:
            raise ValueError(f"messages[{i}] has unknown key(s): {', '.join(extra)}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] is missing {key!r}")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string, got {_describe(m[key])}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _metadata(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a map, got {_describe(value)}")
    _json_compatible(value, "metadata")
    size = len(_pack(value))
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"metadata is {size} bytes encoded, over the limit of {MAX_METADATA_BYTES}"
        )
    return value


def _json_compatible(value: Any, path: str) -> None:
    """Metadata is stored as JSON: string keys, no binary, no ext types, finite floats."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} keys must be strings, got {_describe(k)}")
            _json_compatible(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _json_compatible(v, f"{path}[{i}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value!r}")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ValueError(f"{path} must be JSON-compatible, got {_wire_type(value)}")


def _expect(value: Any, kind: type, name: str, wanted: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {wanted}, got {_describe(value)}")
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_describe(value)}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    return float(value)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of integers, got {_describe(value)}")
    for i, v in enumerate(value):
        _integer(v, f"{name}[{i}]")
    return value


# Year 5138: anything later is not unix seconds (milliseconds, most likely).
_LATEST_UNIX_S = 1e11


def _enqueued_at(
    timestamp: dt.datetime | float | None, headers: Mapping[str, Any] | None
) -> float | None:
    """Enqueue time: the sub-second header when it agrees with the AMQP timestamp."""
    ts: float | None
    if isinstance(timestamp, dt.datetime):
        aware = timestamp if timestamp.tzinfo else timestamp.replace(tzinfo=dt.timezone.utc)
        ts = aware.timestamp()
    elif isinstance(timestamp, (int, float)) and not isinstance(timestamp, bool):
        ts = float(timestamp)
    else:
        ts = None
    if ts is not None and not 0 < ts < _LATEST_UNIX_S:
        ts = None  # milliseconds sent as seconds, or garbage: no enqueue time
    precise = _header_seconds((headers or {}).get(ENQUEUED_AT_HEADER))
    if precise is None:
        return ts
    # The AMQP timestamp is truncated to whole seconds, so a faithful header lies in
    # [ts, ts + 1); one far off was mangled in transit (e.g. sent as a 32-bit float).
    if ts is not None and not ts - 1.0 <= precise <= ts + 2.0:
        return ts
    return precise


def _header_seconds(value: Any) -> float | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float, decimal.Decimal)):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and 0 < seconds < _LATEST_UNIX_S else None


def _pack(data: Any) -> bytes:
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def _wire_type(value: Any) -> str:
    names = {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        bytes: "binary",
        list: "array",
        dict: "map",
        type(None): "nil",
    }
    return names.get(type(value), type(value).__name__)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_wire_type(value)} {text}"
