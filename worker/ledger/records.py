"""What the ledger holds, as dataclasses: one request's state, one worker's heartbeat, and
the rule that folds two states of one request into one.

Rules (the upsert in worker/ledger/statements.py applies the same ones in SQL):
- one row per id; a record sets the fields it gives and keeps the rest (None = not given);
- status moves forward only: queued -> running -> a terminal status;
- a terminal row is final: a later non-terminal record is ignored, a later terminal one
  (the same status, or even another) only touches `updated_at`;
- `attempts` never decreases; `mark_received` adds one per delivery.

PostgreSQL text and JSON cannot hold U+0000, which a model may well generate (byte-level
vocabularies have a token for it) and a producer may send: `storable` turns it into
U+FFFD in text columns and metadata strings. `output_token_ids` stay exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from datetime import UTC, datetime
from typing import Any

from worker.ledger.states import LedgerStatus, RequestSource, WorkerState, parse


def _utc(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise ValueError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return value.astimezone(UTC)


def aware(value: Any) -> Any:
    """`value`, and if it is a naive datetime (SQLite hands back naive UTC), made UTC."""
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


@dataclass(frozen=True)
class RequestRecord:
    """One state of one request: the `requests` columns, None meaning "not given".

    `status` is a `LedgerStatus` (a string is converted; an unknown one is a ValueError).
    """

    id: str
    status: str
    model: str | None = None
    prompt: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_text: str | None = None
    output_token_ids: Sequence[int] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    priority: int | None = None
    worker_id: str | None = None
    attempts: int | None = None
    enqueued_at: datetime | None = None
    received_at: datetime | None = None
    admitted_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    preemptions: int | None = None
    metadata: Mapping[str, Any] | None = None
    source: str | None = None
    client: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"request id must be a non-empty string, got {self.id!r}")
        object.__setattr__(self, "status", parse(LedgerStatus, self.status, "status"))
        if self.source is not None:
            object.__setattr__(self, "source", parse(RequestSource, self.source, "source"))
        for name in TIMESTAMPS:
            object.__setattr__(self, name, _utc(getattr(self, name), name))

    @property
    def terminal(self) -> bool:
        return LedgerStatus(self.status).terminal

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> RequestRecord:
        """The record held by a `requests` row (timestamps as aware UTC datetimes)."""
        return cls(**{name: aware(row[name]) for name in FIELDS})

    def row(self, now: datetime) -> dict[str, Any]:
        """Every column of the `requests` row, for an insert at `now`."""
        values = {name: getattr(self, name) for name in FIELDS}
        for name in _TEXTS:
            values[name] = storable(values[name])
        if self.output_token_ids is not None:
            values["output_token_ids"] = list(self.output_token_ids)
        if self.metadata is not None:
            values["metadata"] = storable(dict(self.metadata))
        values["attempts"] = self.attempts or 0
        return {**values, "created_at": now, "updated_at": now}


FIELDS = tuple(f.name for f in dataclass_fields(RequestRecord))
TIMESTAMPS = tuple(name for name in FIELDS if name.endswith("_at"))
# The fields a later record may set on a row (status and attempts have rules of their own).
MERGED = tuple(name for name in FIELDS if name not in ("id", "status", "attempts"))
_TEXTS = ("prompt", "output_text", "error")
# What tells one delivery's outcome from another's: a final row keeps the first terminal
# record's (status, worker, finish time), whoever writes after it.
OUTCOME = ("id", "status", "worker_id", "finished_at")


def same_outcome(row: Mapping[str, Any], rec: RequestRecord) -> bool:
    """Whether the row's (id, status, worker, finish time) are `rec`'s."""
    return all(aware(row[name]) == getattr(rec, name) for name in OUTCOME)


def storable(value: Any) -> Any:
    """`value` with U+0000 in its strings (map keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, Mapping):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def merge(old: RequestRecord, new: RequestRecord) -> RequestRecord:
    """`old` followed by `new` (same id), by the module's rules."""
    if old.terminal:
        return old
    status = new.status
    if LedgerStatus(new.status).rank < LedgerStatus(old.status).rank:
        status = old.status
    attempts = old.attempts if new.attempts is None else max(old.attempts or 0, new.attempts)
    given = {name: v for name in MERGED if (v := getattr(new, name)) is not None}
    return replace(old, **given, status=status, attempts=attempts)


@dataclass(frozen=True)
class WorkerRecord:
    """A worker's heartbeat: the `workers` columns (last_heartbeat None = now).

    `state` is a `WorkerState`, stored as `WorkerState.recorded` (starting as serving).
    """

    id: str
    state: str
    host: str | None = None
    pid: int | None = None
    device: str | None = None
    model: str | None = None
    queue: str | None = None
    started_at: datetime | None = None
    last_heartbeat: datetime | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    tokens_per_s: float | None = None
    info: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        state = parse(WorkerState, self.state, "state").recorded
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "started_at", _utc(self.started_at, "started_at"))
        object.__setattr__(self, "last_heartbeat", _utc(self.last_heartbeat, "last_heartbeat"))

    def row(self, now: datetime) -> dict[str, Any]:
        """Every column of the `workers` row, for a heartbeat at `now`."""
        values = {f.name: getattr(self, f.name) for f in dataclass_fields(WorkerRecord)}
        values["last_heartbeat"] = self.last_heartbeat or now
        if self.info is not None:
            values["info"] = dict(self.info)
        return values
