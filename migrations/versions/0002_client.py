"""The client a request is accounted to (fair sharing between producer services).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

A nullable column and an index: on PostgreSQL adding a nullable column without a
default does not rewrite the table, so a ledger holding rows upgrades in place; rows
written before keep NULL (no client recorded).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("client", sa.Text(), nullable=True))
    op.create_index("ix_requests_client_finished_at", "requests", ["client", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_requests_client_finished_at", table_name="requests")
    op.drop_column("requests", "client")
