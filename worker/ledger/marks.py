"""Delivery marks: a delivery noted in the ledger before it runs, many per statement.

A mark makes a request's row 'running' with attempts + 1 (a new row: attempts 1) and the
fields the delivery gives, unless the row is final; then the caller gets the final row
and answers from it. Deliveries arrive in bursts and one transaction each would cap a
worker's intake, so the marks made while one round is written are written together in
the next: one autocommitted executemany of `statements.mark_requests`, through the
store's `Retrier` (retried through an outage; a refused round falls back row by row, so
only the delivery the database refuses fails).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.turns import end_of_burst
from worker.ledger import statements
from worker.ledger.records import MERGED, RequestRecord
from worker.ledger.retry import Retrier
from worker.ledger.states import LedgerStatus
from worker.ledger.tables import requests as requests_table
from worker.ledger.writer import LedgerClosed


@dataclass
class _Mark:
    record: RequestRecord
    fields: frozenset[str]
    future: asyncio.Future[RequestRecord | None] = field(repr=False)


class DeliveryMarks:
    """Owns the marks not yet written and the task that writes them (started on demand)."""

    def __init__(self, engine: AsyncEngine, retry: Retrier, *, batch_size: int) -> None:
        # Autocommit: the upsert is one atomic statement, and BEGIN and COMMIT would be
        # two more round trips per round (a round is often one delivery).
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._retry = retry
        self._stmt = statements.RowBatch(
            statements.mark_requests(engine.dialect.name), engine.dialect
        )
        self._batch_size = batch_size
        self._marks: list[_Mark] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def mark(self, id: str, fields: dict[str, Any]) -> RequestRecord | None:
        """Mark a delivery of `id` with `fields`; None to go ahead, else the final row.
        LedgerWriteError if the database refuses it, LedgerClosed if closed first."""
        if self._closing:
            raise LedgerClosed("the ledger store is closed")
        given = RequestRecord(id=id, status=LedgerStatus.RUNNING, **fields)
        future: asyncio.Future[RequestRecord | None] = asyncio.get_running_loop().create_future()
        self._marks.append(_Mark(given, frozenset(fields), future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="ledger-marks")
        return await future

    async def close(self, timeout_s: float | None) -> None:
        """Write the marks made so far (waiting at most `timeout_s`); the rest get
        LedgerClosed."""
        self._closing = True
        if self._task is not None and not self._task.done():
            _, late = await asyncio.wait([self._task], timeout=timeout_s)
            if late:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        for m in self._marks:
            if not m.future.done():
                m.future.set_exception(
                    LedgerClosed(f"ledger closed before the delivery of {m.record.id} was noted")
                )
        self._marks.clear()

    async def _loop(self) -> None:
        await end_of_burst()  # let the deliveries of this burst join
        while self._marks:
            # One round takes the first pending delivery of each id (a second delivery of
            # the same id, rare, goes in the next round so attempts counts both).
            batch: list[_Mark] = []
            rest: list[_Mark] = []
            ids: set[str] = set()
            for m in self._marks:
                if m.future.done():
                    continue  # the caller gave up
                if m.record.id in ids or len(batch) >= self._batch_size:
                    rest.append(m)
                else:
                    ids.add(m.record.id)
                    batch.append(m)
            # Marks made while this batch is written join the next round.
            self._marks = rest
            if not batch:
                break
            try:
                found, refused = await self._retry.batch(
                    batch, self._write, key=lambda m: m.record.id
                )
            except asyncio.CancelledError:  # close() gave up on the database
                self._marks = batch + self._marks
                raise
            for m in batch:
                if m.future.done():
                    continue
                if m.record.id in refused:
                    m.future.set_exception(refused[m.record.id])
                else:
                    m.future.set_result(found.get(m.record.id))

    async def _write(self, marks: Sequence[_Mark]) -> dict[str, RequestRecord]:
        """Upsert the marks in one round trip; returns the rows that were already final."""
        live = [m for m in marks if not m.future.done()]  # callers may give up meanwhile
        if not live:
            return {}
        now = datetime.now(UTC)
        rows = []
        for m in live:
            full = m.record.row(now)
            row = {k: (full[k] if k in m.fields else None) for k in MERGED}
            row.update(id=m.record.id, status=LedgerStatus.RUNNING.value, attempts=1)
            rows.append({**row, "created_at": now, "updated_at": now})
        async with self._engine.connect() as conn:
            # One statement for the batch, the rows bound as arrays (statements.RowBatch).
            went_ahead = {r[0] for r in await self._stmt.execute(conn, rows)}
            final_ids = [m.record.id for m in live if m.record.id not in went_ahead]
            if not final_ids:
                return {}
            t = requests_table.c
            res = await conn.execute(select(requests_table).where(t.id.in_(final_ids)))
            return {row["id"]: RequestRecord.from_row(row) for row in res.mappings()}
