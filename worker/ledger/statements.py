"""The ledger's write statements, built once per SQL dialect (PostgreSQL or SQLite).

Each is one `INSERT ... ON CONFLICT (id) DO UPDATE`, so it is atomic and idempotent on
its own; the conditions in their `set_`/`where` are worker/ledger/records.py's rules in
SQL. The batch statements take row parameters only: an executemany cannot take the
expanding parameter a plain `in_()` would make, so statuses are SQL constants here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, literal_column, or_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import sqltypes

from worker.ledger.records import MERGED, OUTCOME
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
    RETURNING gives each row's outcome as it stands after the statement (OUTCOME's
    columns): the whole row is read back only where the outcome is not the writer's."""
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
    ).returning(*(t[name] for name in OUTCOME))


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


class RowBatch:
    """A batch statement of `statements` executed for many rows at once.

    On PostgreSQL the statement's `VALUES (...)` becomes `SELECT * FROM unnest(...)`:
    one array parameter per column, so the SQL text is the same whatever the batch size
    (compiled once, prepared once per connection) and the rows are bound as a handful of
    arrays, not one parameter set per row; the rest of the statement (ON CONFLICT,
    RETURNING, its constants) is unchanged. Elsewhere (SQLite) the statement runs as an
    executemany. Run with `await batch.execute(conn, rows)` on a SQLAlchemy connection:
    errors are SQLAlchemy's, as for any statement.
    """

    def __init__(self, stmt: Any, dialect: Any) -> None:
        self.stmt = stmt
        self.unnest: str | None = None
        self.columns: tuple[str, ...] = ()
        self.constants: tuple[Any, ...] = ()
        if dialect.name != "postgresql":
            return
        compiled = stmt.compile(dialect=dialect)
        sql: str = compiled.string
        names = list(compiled.positiontup)
        columns = [c.name for c in requests.c if c.name in names]
        head, sep, tail = sql.partition(" VALUES (")
        values, close, rest = tail.partition(") ON CONFLICT")
        casts = values.split(", ")
        if not sep or not close or len(casts) != len(columns) or names[: len(columns)] != columns:
            raise ValueError("not a one-row INSERT ... VALUES ... ON CONFLICT statement")
        arrays = ", ".join(f"{cast}[]" for cast in casts)  # $1::VARCHAR -> $1::VARCHAR[]
        self.unnest = f"{head} SELECT * FROM unnest({arrays}) ON CONFLICT{rest}"
        self.columns = tuple(columns)
        self.constants = tuple(compiled.params[n] for n in names[len(columns) :])
        self._json = {c.name for c in requests.c if isinstance(c.type, sqltypes.JSON)}
        self._dumps = dialect._json_serializer or json.dumps

    async def execute(self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> Any:
        """Execute for `rows` (each a dict of every column); the result, as `execute`'s."""
        if self.unnest is None:
            return await conn.execute(self.stmt, list(rows))
        dumps, json_columns = self._dumps, self._json
        arrays: list[Any] = []
        for name in self.columns:
            column = [row[name] for row in rows]
            if name in json_columns:
                column = [None if v is None else dumps(v) for v in column]
            arrays.append(column)
        return await conn.exec_driver_sql(self.unnest, (*arrays, *self.constants))
