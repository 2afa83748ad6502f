"""What the admin commands read from the ledger, and the two writes they make.

Reads: the `workers` table, one `requests` row, aggregate stats over a time window
(percentiles by `percentile_cont` on PostgreSQL, computed in Python on SQLite), and a
streamed export. Writes, both conditional single-statement upserts so they cannot race
a worker into an inconsistent row:
- `cancel`: a request not yet running (no row, or `queued`) becomes `cancelled`, so the
  worker that later receives its message finds a terminal row and answers from it;
- `reset_for_replay`: a `rejected` or `failed` row becomes `queued` again (error
  cleared), so a dead letter republished by `kvflow dlq replay` runs instead of being
  answered from the ledger.

Every database failure is raised as DatabaseUnavailable, SchemaError or AdminError with
the URL's password masked.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from broker.messages import CANCELLED
from worker.admin.common import AdminError
from worker.ledger.migrate import (
    SchemaError,
    describe_error,
    is_transient,
    open_engine,
    redact,
    unreachable,
)
from worker.ledger.tables import ACTIVE_STATUSES, TERMINAL_STATUSES
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

CANCEL_TEXT = "cancelled by an operator"
REPLAYABLE = ("rejected", "failed")
LATENCIES = ("ttft_s", "e2e_s", "queue_s")


def _aware(value: Any) -> Any:
    """SQLite hands back naive UTC datetimes; make every timestamp aware."""
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _row(mapping: Any) -> dict[str, Any]:
    return {k: _aware(v) for k, v in dict(mapping).items()}


def percentile(values: Sequence[float], q: float) -> float | None:
    """PostgreSQL's percentile_cont: linear interpolation between the closest ranks."""
    data = sorted(values)
    if not data:
        return None
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


class LedgerReader:
    """An engine on the ledger database, used by one command and then closed."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = url
        self.engine = open_engine(url, timeout_s=timeout_s)
        self.dialect = self.engine.dialect.name

    async def close(self) -> None:
        await self.engine.dispose()

    async def __aenter__(self) -> LedgerReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _error(self, exc: BaseException) -> Exception:
        if is_transient(exc):
            return unreachable(self.url, exc)
        reason = describe_error(exc, self.url)
        if "does not exist" in reason or "no such table" in reason:
            return SchemaError(
                f"the ledger at {redact(self.url)} has no kvflow tables ({reason}): "
                "run `kvflow db upgrade`"
            )
        return AdminError(f"ledger query failed on {redact(self.url)}: {reason}")

    @contextlib.asynccontextmanager
    async def connect(self, *, write: bool = False) -> AsyncIterator[AsyncConnection]:
        """A connection (a transaction if `write`); database errors are translated."""
        try:
            async with self.engine.begin() if write else self.engine.connect() as conn:
                yield conn
        except (OSError, TimeoutError, sa.exc.SQLAlchemyError) as e:
            raise self._error(e) from None

    # -- reads ---------------------------------------------------------------------------

    async def check(self) -> None:
        """Fail now (unreachable, or no tables) rather than halfway through a command."""
        async with self.connect() as conn:
            await conn.execute(select(requests_table.c.id).limit(1))

    async def workers(self) -> list[dict[str, Any]]:
        stmt = select(workers_table).order_by(workers_table.c.started_at, workers_table.c.id)
        async with self.connect() as conn:
            return [_row(r) for r in (await conn.execute(stmt)).mappings().all()]

    async def request(self, id: str) -> dict[str, Any] | None:
        stmt = select(requests_table).where(requests_table.c.id == id)
        async with self.connect() as conn:
            row = (await conn.execute(stmt)).mappings().first()
        return None if row is None else _row(row)

    async def requests(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Status and error of each id that has a row."""
        if not ids:
            return {}
        t = requests_table.c
        stmt = select(t.id, t.status, t.error_code, t.error).where(t.id.in_(list(ids)))
        async with self.connect() as conn:
            return {r["id"]: dict(r) for r in (await conn.execute(stmt)).mappings().all()}

    def _window(self, since: datetime | None, until: datetime | None) -> list[Any]:
        t = requests_table.c
        where: list[Any] = [t.finished_at.is_not(None)]
        if since is not None:
            where.append(t.finished_at >= since)
        if until is not None:
            where.append(t.finished_at < until)
        return where

    async def summary(self, since: datetime | None, until: datetime | None) -> dict[str, Any]:
        """Counts by status, tokens, throughput and latency percentiles of the requests
        that finished in [since, until); `active` counts queued/running rows now.

        Throughput is completion tokens over the busy span: from the first admission
        to the last finish among those requests.
        """
        t = requests_table.c
        start = func.min(func.coalesce(t.admitted_at, t.received_at, t.finished_at))
        by_status = (
            select(
                t.status,
                func.count(),
                func.sum(t.prompt_tokens),
                func.sum(t.completion_tokens),
                start,
                func.max(t.finished_at),
            )
            .where(*self._window(since, until))
            .group_by(t.status)
        )
        active = select(t.status, func.count()).where(t.status.in_(ACTIVE_STATUSES))
        counts = dict.fromkeys(TERMINAL_STATUSES, 0)
        prompt = completion = 0
        first: datetime | None = None
        last: datetime | None = None
        async with self.connect() as conn:
            for status, n, pt, ct, lo, hi in (await conn.execute(by_status)).all():
                counts[status] = int(n)
                prompt += int(pt or 0)
                completion += int(ct or 0)
                lo, hi = _aware(lo), _aware(hi)
                first = lo if first is None or (lo is not None and lo < first) else first
                last = hi if last is None or (hi is not None and hi > last) else last
            now_active: dict[str, int] = {
                str(s): int(n) for s, n in (await conn.execute(active.group_by(t.status))).all()
            }
            latency = await self._latencies(conn, since, until)
        span = (last - first).total_seconds() if first and last else 0.0
        return {
            "since": since,
            "until": until,
            "counts": counts,
            "active": {s: int(now_active.get(s, 0)) for s in ACTIVE_STATUSES},
            "completed": counts["completed"],
            "failed": counts["failed"],
            "finished": sum(counts.values()),
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "busy_s": span,
            "output_tokens_per_s": completion / span if span > 0 else 0.0,
            "latency_s": latency,
        }

    async def _latencies(
        self, conn: AsyncConnection, since: datetime | None, until: datetime | None
    ) -> dict[str, dict[str, float | None]]:
        t = requests_table.c
        where = [*self._window(since, until), t.status == "completed"]
        cols: list[ColumnElement[Any]] = [t[name] for name in LATENCIES]
        if self.dialect == "postgresql":
            aggs: list[Any] = []
            for col in cols:
                aggs += [
                    func.percentile_cont(0.5).within_group(col),
                    func.percentile_cont(0.99).within_group(col),
                    func.avg(col),
                ]
            row = (await conn.execute(select(*aggs).where(*where))).one()
            return {
                name: {
                    "p50": _float(row[3 * i]),
                    "p99": _float(row[3 * i + 1]),
                    "mean": _float(row[3 * i + 2]),
                }
                for i, name in enumerate(LATENCIES)
            }
        rows = (await conn.execute(select(*cols).where(*where))).all()
        out: dict[str, dict[str, float | None]] = {}
        for i, name in enumerate(LATENCIES):
            values = [float(r[i]) for r in rows if r[i] is not None]
            out[name] = {
                "p50": percentile(values, 0.5),
                "p99": percentile(values, 0.99),
                "mean": statistics.fmean(values) if values else None,
            }
        return out

    async def count(self, since: datetime | None, until: datetime | None) -> int:
        stmt = select(func.count()).select_from(requests_table).where(*self._window(since, until))
        async with self.connect() as conn:
            return int(await conn.scalar(stmt) or 0)

    async def export(
        self, since: datetime | None, until: datetime | None
    ) -> AsyncIterator[dict[str, Any]]:
        """Every row that finished in [since, until), oldest first, streamed."""
        t = requests_table.c
        stmt = (
            select(requests_table)
            .where(*self._window(since, until))
            .order_by(t.finished_at, t.id)
            .execution_options(yield_per=500)
        )
        async with self.connect() as conn:
            try:
                result = await conn.stream(stmt)
                async for row in result.mappings():
                    yield _row(row)
            except (OSError, TimeoutError, sa.exc.SQLAlchemyError) as e:
                raise self._error(e) from None

    # -- writes ----------------------------------------------------------------------------

    async def cancel(self, id: str) -> tuple[bool, dict[str, Any] | None]:
        """Mark `id` cancelled if it has no row or a queued one (not running, not final).

        Returns (written, the row as it is now).
        """
        now = datetime.now(UTC)
        insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        values = {
            "status": "cancelled",
            "error": CANCEL_TEXT,
            "error_code": CANCELLED,
            "finished_at": now,
            "updated_at": now,
        }
        t = requests_table.c
        stmt = (
            insert(requests_table)
            .values(id=id, attempts=0, created_at=now, **values)
            .on_conflict_do_update(
                index_elements=[t.id],
                set_=values,
                where=t.status.not_in([*TERMINAL_STATUSES, "running"]),
            )
            .returning(t.id)
        )
        async with self.connect(write=True) as conn:
            written = (await conn.execute(stmt)).first() is not None
            row = (await conn.execute(select(requests_table).where(t.id == id))).mappings()
            current = row.first()
        return written, None if current is None else _row(current)

    async def reset_for_replay(self, id: str) -> tuple[bool, str | None]:
        """Make a rejected/failed row `queued` again (error and finish cleared).

        Returns (reset, the status it had: None if there is no row).
        """
        t = requests_table.c
        stmt = (
            update(requests_table)
            .where(t.id == id, t.status.in_(REPLAYABLE))
            .values(
                status="queued",
                error=None,
                error_code=None,
                finished_at=None,
                updated_at=datetime.now(UTC),
            )
            .returning(t.id)
        )
        async with self.connect(write=True) as conn:
            before = await conn.scalar(select(t.status).where(t.id == id))
            reset = (await conn.execute(stmt)).first() is not None
        return reset, before


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
