"""The replies a worker sends to a request's ``reply_to``: deltas, one result, or an error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from broker.messages.checks import wire_type
from broker.messages.contract import ERROR_CODES, REPLY_TYPES, pack


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
    return pack(reply)


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
    return pack(reply)


def encode_error(id: str | None, code: str, message: str) -> bytes:
    """An ``error`` reply, sent instead of a result; `code` must be in `ERROR_CODES`."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}; use one of {sorted(ERROR_CODES)}")
    return pack({"id": id, "type": "error", "error": {"code": code, "message": message}})


def decode_reply(body: bytes) -> dict[str, Any]:
    """Decode a reply; raises ValueError unless it is a map with a known ``type``."""
    try:
        reply = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"reply is not valid msgpack: {e}") from None
    if not isinstance(reply, dict):
        raise ValueError(f"reply must be a msgpack map, got {wire_type(reply)}")
    if reply.get("type") not in REPLY_TYPES:
        raise ValueError(
            f"reply type must be one of {sorted(REPLY_TYPES)}, got {reply.get('type')!r}"
        )
    return reply
