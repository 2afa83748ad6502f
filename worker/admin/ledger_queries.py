"""What the admin commands read from the ledger (they write through `LedgerStore`).

The `workers` table, one `requests` row, aggregate stats over a time window (percentiles
by `percentile_cont` on PostgreSQL, computed in Python on SQLite), and a streamed export.
Every database failure is raised as DatabaseUnavailable, SchemaError or AdminError with
the URL's password masked.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from broker.redact import redact_url
from worker.admin.common import AdminError
from worker.ledger.migrate import (
    SchemaError,
    describe_error,
    is_transient,
    open_engine,
    unreachable,
)
from worker.ledger.records import aware
from worker.ledger.states import ACTIVE, TERMINAL, LedgerStatus
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

LATENCIES = ("ttft_s", "e2e_s", "queue_s")


def _row(mapping: Any) -> dict[str, Any]:
    return {k: aware(v) for k, v in dict(mapping).items()}


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
                f"the ledger at {redact_url(self.url)} has no kvflow tables ({reason}): "
                "run `kvflow db upgrade`"
            )
        return AdminError(f"ledger query failed on {redact_url(self.url)}: {reason}")

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
        active = select(t.status, func.count()).where(t.status.in_([s.value for s in ACTIVE]))
        counts = {s.value: 0 for s in TERMINAL}
        prompt = completion = 0
        first: datetime | None = None
        last: datetime | None = None
        async with self.connect() as conn:
            for status, n, pt, ct, lo, hi in (await conn.execute(by_status)).all():
                counts[status] = int(n)
                prompt += int(pt or 0)
                completion += int(ct or 0)
                lo, hi = aware(lo), aware(hi)
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
            "active": {s.value: int(now_active.get(s, 0)) for s in ACTIVE},
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
        where = [*self._window(since, until), t.status == LedgerStatus.COMPLETED.value]
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

    async def clients(self, since: datetime | None, until: datetime | None) -> list[dict[str, Any]]:
        """Per client, of the requests that finished in [since, until): how many, the
        service they received (prompt tokens + 2 x generated tokens, the fair policy's
        weights), and the median queue delay and time to first token of the completed."""
        t = requests_table.c
        client = func.coalesce(t.client, "(none)")
        stmt = (
            select(
                client,
                func.count(),
                func.sum(t.prompt_tokens),
                func.sum(t.completion_tokens),
            )
            .where(*self._window(since, until))
            .group_by(client)
            .order_by(client)
        )
        where = [*self._window(since, until), t.status == LedgerStatus.COMPLETED.value]
        async with self.connect() as conn:
            totals = (await conn.execute(stmt)).all()
            delays = (await conn.execute(select(client, t.queue_s, t.ttft_s).where(*where))).all()
        by_client: dict[str, tuple[list[float], list[float]]] = {}
        for name, queue_s, ttft_s in delays:
            q, f = by_client.setdefault(str(name), ([], []))
            if queue_s is not None:
                q.append(float(queue_s))
            if ttft_s is not None:
                f.append(float(ttft_s))
        out = []
        for name, n, pt, ct in totals:
            q, f = by_client.get(str(name), ([], []))
            prompt, completion = int(pt or 0), int(ct or 0)
            out.append(
                {
                    "client": str(name),
                    "requests": int(n),
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "service": prompt + 2 * completion,
                    "queue_p50_s": percentile(sorted(q), 0.5),
                    "ttft_p50_s": percentile(sorted(f), 0.5),
                }
            )
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


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
