"""The ledger's schema as SQLAlchemy Core metadata: one `requests` row per request id,
one `workers` row per worker process.

The types work on PostgreSQL and SQLite alike: JSON becomes JSONB on PostgreSQL, and
timestamps are `timestamptz` (stored as naive UTC text on SQLite). Nullable columns
mean "not known (yet)"; the store's upsert never overwrites a known value with NULL.

This module is the source of truth for code; `migrations/versions/` holds the same
schema as explicit, hand-written migrations (a test checks that the two agree). The
values a status, source or state column may hold come from `worker.ledger.states`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeEngine

from worker.ledger.states import (
    ACTIVE,
    RECORDED_WORKER_STATES,
    TERMINAL,
    LedgerStatus,
    RequestSource,
)

# The values as tuples of strings, for code that has not moved to the enums yet.
ACTIVE_STATUSES: tuple[str, ...] = ACTIVE
TERMINAL_STATUSES: tuple[str, ...] = TERMINAL
STATUSES: tuple[str, ...] = tuple(LedgerStatus)
SOURCES: tuple[str, ...] = tuple(RequestSource)
WORKER_STATES: tuple[str, ...] = RECORDED_WORKER_STATES


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def json_type() -> TypeEngine[Any]:
    """JSON (JSONB on PostgreSQL); Python None is stored as SQL NULL, not JSON 'null'."""
    return JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def timestamp() -> DateTime:
    return DateTime(timezone=True)


metadata = MetaData()

requests = Table(
    "requests",
    metadata,
    Column("id", Text, primary_key=True),
    Column("status", Text, nullable=False),
    Column("model", Text),
    Column("prompt", Text),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("output_text", Text),
    Column("output_token_ids", json_type()),
    Column("finish_reason", Text),
    Column("error", Text),
    Column("error_code", Text),
    Column("priority", Integer),
    Column("worker_id", Text),
    # deliveries seen (incremented by mark_received); never decreases
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("enqueued_at", timestamp()),
    Column("received_at", timestamp()),
    Column("admitted_at", timestamp()),
    Column("first_token_at", timestamp()),
    Column("finished_at", timestamp()),
    Column("queue_s", Float),
    Column("ttft_s", Float),
    Column("prefill_s", Float),
    Column("decode_s", Float),
    Column("e2e_s", Float),
    Column("itl_mean_s", Float),
    Column("itl_p50_s", Float),
    Column("itl_p99_s", Float),
    Column("preemptions", Integer),
    Column("metadata", json_type()),
    Column("source", Text),
    # The producer service the request is accounted to (fair sharing); NULL on rows
    # written before revision 0002.
    Column("client", Text),
    Column("created_at", timestamp(), nullable=False),
    Column("updated_at", timestamp(), nullable=False),
    CheckConstraint(f"status IN ({_quoted(STATUSES)})", name="ck_requests_status"),
    CheckConstraint(f"source IN ({_quoted(SOURCES)})", name="ck_requests_source"),
    # (status, finished_at) also serves queries on status alone (its leading column),
    # so there is no separate status index to pay for on every write.
    Index("ix_requests_status_finished_at", "status", "finished_at"),
    Index("ix_requests_finished_at", "finished_at"),
    Index("ix_requests_worker_id", "worker_id"),
    Index("ix_requests_client_finished_at", "client", "finished_at"),
)

workers = Table(
    "workers",
    metadata,
    Column("id", Text, primary_key=True),  # host:pid:uuid
    Column("host", Text),
    Column("pid", Integer),
    Column("device", Text),
    Column("model", Text),
    Column("queue", Text),
    Column("state", Text, nullable=False),
    Column("started_at", timestamp()),
    Column("last_heartbeat", timestamp(), nullable=False),
    Column("running", Integer),
    Column("waiting", Integer),
    Column("kv_usage", Float),
    Column("tokens_per_s", Float),
    Column("info", json_type()),
    CheckConstraint(f"state IN ({_quoted(WORKER_STATES)})", name="ck_workers_state"),
    Index("ix_workers_last_heartbeat", "last_heartbeat"),
)
