"""The ledger's write statements, built once per SQL dialect (PostgreSQL or SQLite).

Each is one `INSERT ... ON CONFLICT (id) DO UPDATE`, so it is atomic and idempotent on
its own; the conditions in their `set_`/`where` are worker/ledger/records.py's rules in
SQL. The batch statements take row parameters only: an executemany cannot take the
expanding parameter a plain `in_()` would make, so statuses are SQL constants here.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, literal_column, or_
from sqlalchemy.dialects import postgresql, sqlite

from worker.ledger.records import MERGED
from worker.ledger.states import ACTIVE, TERMINAL, LedgerStatus
from worker.ledger.tables import requests, workers


def insert(dialect: str) -> Any:
    """The dialect's `insert` (the one with `on_conflict_do_update`)."""
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _sql(status: LedgerStatus) -> ColumnElement[Any]:
    return literal_column(f"'{status.value}'")


def _is_final(status: ColumnElement[Any]) -> ColumnElement[bool]:
    return status.in_([_sql(s) for s in TERMINAL])


def upsert_requests(dialect: str) -> Any:
    """The batch upsert of records: one statement, executed with many parameter sets.
    RETURNING gives each row as it stands after the statement."""
    stmt = insert(dialect)(requests)
    t, ex = requests.c, stmt.excluded
    final = _is_final(t.status)
    backwards = and_(t.status == _sql(LedgerStatus.RUNNING), ex.status == _sql(LedgerStatus.QUEUED))
    set_: dict[str, Any] = {
        name: case((final, t[name]), else_=func.coalesce(ex[name], t[name])) for name in MERGED
    }
    set_["status"] = case((final, t.status), (backwards, t.status), else_=ex.status)
    set_["attempts"] = case((ex.attempts > t.attempts, ex.attempts), else_=t.attempts)
    set_["updated_at"] = ex.updated_at
    # A terminal record always updates (keeping a final row's values), so it always gets
    # its committed row back.
    return stmt.on_conflict_do_update(
        index_elements=[t.id], set_=set_, where=or_(~final, _is_final(ex.status))
    ).returning(*requests.c)


def mark_requests(dialect: str) -> Any:
    """mark_received's batch upsert: a new row, or 'running' with attempts + 1 unless the
    row is final. Columns given as NULL keep their stored value. RETURNING names the ids
    that went ahead (the others were final)."""
    stmt = insert(dialect)(requests)
    t, ex = requests.c, stmt.excluded
    set_: dict[str, Any] = {name: func.coalesce(ex[name], t[name]) for name in MERGED}
    set_.update(status=LedgerStatus.RUNNING.value, attempts=t.attempts + 1)
    set_["updated_at"] = ex.updated_at
    return stmt.on_conflict_do_update(
        index_elements=[t.id], set_=set_, where=~_is_final(t.status)
    ).returning(t.id)


def upsert_worker(dialect: str, values: dict[str, Any]) -> Any:
    """A heartbeat: the worker's row, `started_at` kept when the heartbeat has none."""
    stmt = insert(dialect)(workers).values(**values)
    t = workers.c
    set_: dict[str, Any] = {k: stmt.excluded[k] for k in values if k != "id"}
    set_["started_at"] = func.coalesce(stmt.excluded.started_at, t.started_at)
    return stmt.on_conflict_do_update(index_elements=[t.id], set_=set_)


def cancel_unstarted(dialect: str, id: str, values: dict[str, Any]) -> Any:
    """Make `id` cancelled with `values` if it has no row or a queued one: a request
    that is running belongs to its worker, and a final one stays final. RETURNING names
    the id when it was written."""
    t = requests.c
    now = values["updated_at"]
    return (
        insert(dialect)(requests)
        .values(id=id, attempts=0, created_at=now, **values)
        .on_conflict_do_update(
            index_elements=[t.id], set_=values, where=t.status == LedgerStatus.QUEUED.value
        )
        .returning(t.id)
    )


def requeue_final(id: str, statuses: tuple[LedgerStatus, ...], values: dict[str, Any]) -> Any:
    """Move `id` from one of `statuses` (final ones) back to queued with `values`: the one
    write that reopens a final row, for a replay an operator asked for."""
    if set(statuses) & set(ACTIVE):
        raise ValueError(f"only final rows are reopened, not {', '.join(statuses)}")
    t = requests.c
    return (
        requests.update()
        .where(t.id == id, t.status.in_([s.value for s in statuses]))
        .values(status=LedgerStatus.QUEUED.value, **values)
        .returning(t.id)
    )
