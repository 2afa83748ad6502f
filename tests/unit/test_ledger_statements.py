"""worker.ledger.statements.RowBatch: a batch statement bound as one array per column."""

from __future__ import annotations

from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.dialects.sqlite import aiosqlite

from worker.ledger import statements
from worker.ledger.tables import requests


def test_the_batch_upsert_selects_from_arrays_with_its_rules_unchanged() -> None:
    dialect = asyncpg.dialect()
    stmt = statements.upsert_requests("postgresql")
    batch = statements.RowBatch(stmt, dialect)
    assert batch.unnest is not None
    one_row = stmt.compile(dialect=dialect).string
    head, _, rest = one_row.partition(" VALUES (")
    assert batch.unnest.startswith(f"{head} SELECT * FROM unnest($1::VARCHAR[], ")
    # ON CONFLICT ... RETURNING: the same text as the one-row statement's
    assert batch.unnest.endswith(rest[rest.index(") ON CONFLICT") + 1 :])
    assert batch.columns == tuple(c.name for c in requests.c)
    assert batch.constants == ()


def test_the_marks_keep_their_constants_as_plain_parameters() -> None:
    batch = statements.RowBatch(statements.mark_requests("postgresql"), asyncpg.dialect())
    assert batch.unnest is not None
    n = len(batch.columns)
    assert f"${n}::TIMESTAMP WITH TIME ZONE[])" in batch.unnest
    assert batch.constants == ("running", 1)  # the status set and the attempts step
    assert f"${n + 1}::VARCHAR" in batch.unnest and f"${n + 1}::VARCHAR[]" not in batch.unnest


def test_sqlite_runs_the_statement_as_it_is() -> None:
    batch = statements.RowBatch(statements.upsert_requests("sqlite"), aiosqlite.dialect())
    assert batch.unnest is None
