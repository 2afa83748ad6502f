"""The ledger: requests and workers.

Revision ID: 0001
Revises:
Create Date: 2025-11-29

Written out in full (not imported from worker.ledger.tables) so that this revision
stays what it was when released; tests check that it matches the current metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON(none_as_null=True).with_variant(
        postgresql.JSONB(none_as_null=True), "postgresql"
    )


def _ts() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "requests",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("model", sa.Text()),
        sa.Column("prompt", sa.Text()),
        sa.Column("prompt_tokens", sa.Integer()),
        sa.Column("completion_tokens", sa.Integer()),
        sa.Column("cached_tokens", sa.Integer()),
        sa.Column("output_text", sa.Text()),
        sa.Column("output_token_ids", _json()),
        sa.Column("finish_reason", sa.Text()),
        sa.Column("error", sa.Text()),
        sa.Column("error_code", sa.Text()),
        sa.Column("priority", sa.Integer()),
        sa.Column("worker_id", sa.Text()),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("enqueued_at", _ts()),
        sa.Column("received_at", _ts()),
        sa.Column("admitted_at", _ts()),
        sa.Column("first_token_at", _ts()),
        sa.Column("finished_at", _ts()),
        sa.Column("queue_s", sa.Float()),
        sa.Column("ttft_s", sa.Float()),
        sa.Column("prefill_s", sa.Float()),
        sa.Column("decode_s", sa.Float()),
        sa.Column("e2e_s", sa.Float()),
        sa.Column("itl_mean_s", sa.Float()),
        sa.Column("itl_p50_s", sa.Float()),
        sa.Column("itl_p99_s", sa.Float()),
        sa.Column("preemptions", sa.Integer()),
        sa.Column("metadata", _json()),
        sa.Column("source", sa.Text()),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'completed', 'failed', 'rejected', "
            "'expired', 'cancelled')",
            name="ck_requests_status",
        ),
        sa.CheckConstraint("source IN ('queue', 'batch')", name="ck_requests_source"),
    )
    op.create_index("ix_requests_status_finished_at", "requests", ["status", "finished_at"])
    op.create_index("ix_requests_finished_at", "requests", ["finished_at"])
    op.create_index("ix_requests_worker_id", "requests", ["worker_id"])

    op.create_table(
        "workers",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("host", sa.Text()),
        sa.Column("pid", sa.Integer()),
        sa.Column("device", sa.Text()),
        sa.Column("model", sa.Text()),
        sa.Column("queue", sa.Text()),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("started_at", _ts()),
        sa.Column("last_heartbeat", _ts(), nullable=False),
        sa.Column("running", sa.Integer()),
        sa.Column("waiting", sa.Integer()),
        sa.Column("kv_usage", sa.Float()),
        sa.Column("tokens_per_s", sa.Float()),
        sa.Column("info", _json()),
        sa.CheckConstraint(
            "state IN ('serving', 'draining', 'drained', 'stopped')", name="ck_workers_state"
        ),
    )
    op.create_index("ix_workers_last_heartbeat", "workers", ["last_heartbeat"])


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("requests")
