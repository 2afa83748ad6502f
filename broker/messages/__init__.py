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
``client`` (string, at most 64 printable characters)
    The producer service the request is accounted to for fair sharing; when absent,
    the AMQP ``app_id``, else "default".
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

from broker.messages.contract import (
    ACCEPTED_CONTENT_TYPES,
    CANCELLED,
    CONTENT_TYPE,
    CRASHES_HEADER,
    DEFAULT_CLIENT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DELIVERY_COUNT_HEADER,
    ENQUEUED_AT_HEADER,
    ERROR_CODES,
    EXPIRED,
    INTERNAL,
    INVALID_REQUEST,
    MAX_ID_LENGTH,
    MAX_METADATA_BYTES,
    PROMPT_FIELDS,
    PROMPT_TOO_LONG,
    REPLY_TYPES,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    TIMING_FIELDS,
    ErrorCode,
    InvalidRequest,
    RequestMessage,
)
from broker.messages.replies import decode_reply, encode_delta, encode_error, encode_result
from broker.messages.requests import client_of, decode_request, encode_request

__all__ = [
    "ACCEPTED_CONTENT_TYPES",
    "CANCELLED",
    "CONTENT_TYPE",
    "CRASHES_HEADER",
    "DEFAULT_CLIENT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DELIVERY_COUNT_HEADER",
    "ENQUEUED_AT_HEADER",
    "ERROR_CODES",
    "EXPIRED",
    "INTERNAL",
    "INVALID_REQUEST",
    "MAX_ID_LENGTH",
    "MAX_METADATA_BYTES",
    "PROMPT_FIELDS",
    "PROMPT_TOO_LONG",
    "REPLY_TYPES",
    "REQUEST_FIELDS",
    "SAMPLING_FIELDS",
    "TIMING_FIELDS",
    "ErrorCode",
    "InvalidRequest",
    "RequestMessage",
    "client_of",
    "decode_reply",
    "decode_request",
    "encode_delta",
    "encode_error",
    "encode_request",
    "encode_result",
]
