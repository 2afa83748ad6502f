"""Contract v1's vocabulary: content types, headers, limits, error codes, fields, and the decoded request."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

CONTENT_TYPE = "application/msgpack"

ACCEPTED_CONTENT_TYPES = frozenset({CONTENT_TYPE, "application/x-msgpack"})

ENQUEUED_AT_HEADER = "x-enqueued-at"

DELIVERY_COUNT_HEADER = "x-delivery-count"
# Set by workers on a request they put back on its queue after their engine died while
# running it: how many engine crashes it was part of (it then runs alone).
CRASHES_HEADER = "x-kvflow-crashes"

MAX_ID_LENGTH = 255

MAX_METADATA_BYTES = 4096
MAX_METADATA_DEPTH = 32
MAX_MESSAGES = 1024  # chat messages in one request
MAX_CLIENT_LENGTH = 64
DEFAULT_CLIENT = "default"  # a request that names no client (body `client`, AMQP app_id)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20


class ErrorCode(enum.StrEnum):
    """The ``code`` of an error reply (and of a ledger row that ended in error)."""

    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


INVALID_REQUEST = ErrorCode.INVALID_REQUEST
PROMPT_TOO_LONG = ErrorCode.PROMPT_TOO_LONG
EXPIRED = ErrorCode.EXPIRED
CANCELLED = ErrorCode.CANCELLED
INTERNAL = ErrorCode.INTERNAL
ERROR_CODES = frozenset(ErrorCode)

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


class FieldKind(enum.StrEnum):
    """The wire-level kind of a sampling field."""

    INT = "int"
    NUMBER = "number"
    BOOL = "bool"
    STOP = "stop"  # a string or a list of strings
    INT_LIST = "int_list"


# The sampling fields by kind; the names match worker.request.SamplingParams.
SAMPLING_FIELDS: Mapping[str, FieldKind] = {
    "max_tokens": FieldKind.INT,
    "temperature": FieldKind.NUMBER,
    "top_p": FieldKind.NUMBER,
    "top_k": FieldKind.INT,
    "min_p": FieldKind.NUMBER,
    "seed": FieldKind.INT,
    "stop": FieldKind.STOP,
    "stop_token_ids": FieldKind.INT_LIST,
    "ignore_eos": FieldKind.BOOL,
    "min_tokens": FieldKind.INT,
    "repetition_penalty": FieldKind.NUMBER,
    "presence_penalty": FieldKind.NUMBER,
    "frequency_penalty": FieldKind.NUMBER,
    "logprobs": FieldKind.INT,
}

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")

REQUEST_FIELDS = frozenset(
    {
        "id",
        *PROMPT_FIELDS,
        *SAMPLING_FIELDS,
        "priority",
        "deadline",
        "stream",
        "metadata",
        "client",
    }
)


class InvalidRequest(ValueError):
    """A request body that breaks contract v1; the worker answers it with an error reply.

    `request_id`, `reply_to` and `correlation_id` are whatever could be recovered, so
    the caller can still address the error reply (all may be None).
    """

    def __init__(
        self,
        code: ErrorCode,
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
    `client` is the producer service the request is accounted to: the body's `client`,
    else the AMQP `app_id`, else "default".
    `delivery_count` is the quorum queue's count of earlier returns of this message;
    `crashes`, how many engine crashes the request was part of (`CRASHES_HEADER`).
    """

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    client: str = DEFAULT_CLIENT
    deadline: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    enqueued_at: float | None = None
    redelivered: bool = False
    delivery_count: int | None = None
    crashes: int = 0


def pack(data: Any) -> bytes:
    """msgpack with binary kept apart from text, as every kvflow message is encoded."""
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed
