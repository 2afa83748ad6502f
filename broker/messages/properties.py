"""A request's AMQP properties: its enqueue time, expiration and delivery count."""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Mapping
from typing import Any

from broker.messages.contract import CRASHES_HEADER, DELIVERY_COUNT_HEADER, ENQUEUED_AT_HEADER

# Year 5138: anything later is not unix seconds (milliseconds, most likely).
_LATEST_UNIX_S = 1e11


def enqueued_at(
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


def delivery_count(headers: Mapping[str, Any] | None) -> int | None:
    """The quorum queue's count of earlier failed deliveries (None when absent)."""
    count = (headers or {}).get(DELIVERY_COUNT_HEADER)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def crashes(headers: Mapping[str, Any] | None) -> int:
    """How many engine crashes the request was part of (0 when absent or malformed)."""
    count = (headers or {}).get(CRASHES_HEADER)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0
