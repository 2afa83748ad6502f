"""The ledger writer: every state of every request, batched into PostgreSQL (or SQLite).

`record()` queues a `RequestRecord` and returns at once; one background task writes
up to `batch_size` queued records per transaction (an `INSERT ... ON CONFLICT (id) DO
UPDATE` executemany) and then resolves their futures: for a terminal record, with the
row as the ledger holds it after the commit. That row is the request's one outcome: it
may be another delivery's, when two workers ran the same request (a redelivery after a
lost connection) and the other committed first; replies are sent from it.
`mark_received()` notes a delivery; the marks of concurrent deliveries are written
together, many per statement, by a second task.

Both tasks write through one `Retrier` (worker/ledger/retry.py): when the database is
slow the batches grow; when it is down the batch waits and is retried with capped
exponential backoff (logged once per outage), so a record is delayed, never lost, until
`close()` gives up on it; when the database refuses a row, only that row fails. The
rules every write follows, and why retrying is safe, are in worker/ledger/records.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from broker.redact import redact_url
from worker.ledger import statements
from worker.ledger.migrate import check_schema_async, is_transient, open_engine, unreachable
from worker.ledger.records import (
    MERGED,
    RequestRecord,
    WorkerRecord,
    aware,
    merge,
    storable,
)
from worker.ledger.retry import LedgerWriteError, Retrier
from worker.ledger.states import LedgerStatus
from worker.ledger.tables import requests as requests_table

# Importable from here until every caller uses the package (`worker.ledger`).
__all__ = [
    "Latency",
    "LedgerClosed",
    "LedgerStore",
    "LedgerWriteError",
    "RequestRecord",
    "WorkerRecord",
    "merge",
    "storable",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# A dead letter whose row has one of these may be replayed (its row reopened as queued).
REPLAYABLE = (LedgerStatus.REJECTED, LedgerStatus.FAILED)


class LedgerClosed(RuntimeError):
    """The store was closed (or gave up) before this record was written."""


@dataclass
class Latency:
    """A running total the metrics module reads: `count` events taking `total_s`."""

    count: int = 0
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds


@dataclass
class _Pending:
    record: RequestRecord
    future: asyncio.Future[RequestRecord | None] = field(repr=False)


@dataclass
class _Mark:
    record: RequestRecord
    fields: frozenset[str]
    future: asyncio.Future[RequestRecord | None] = field(repr=False)


class LedgerStore:
    """Async, batched, idempotent writer of the `requests` and `workers` tables.

    Create with `await LedgerStore.open(url)`; end with `await store.close()`. For the
    metrics module: `pending` (queued, not committed), `write_latency` (committed batch
    transactions and their total seconds), `records_written`, `errors` (failed write
    attempts, transient or not).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        url: str,
        *,
        batch_size: int,
        flush_interval_s: float,
        retry_max_s: float,
    ) -> None:
        """Internal: use `LedgerStore.open`, which checks the schema first."""
        self._engine = engine
        # Autocommit for the marks: their upsert is one atomic statement, and BEGIN and
        # COMMIT would be two more round trips per batch (a batch is often one delivery).
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._url = url
        self._dialect = engine.dialect.name
        self._upsert = statements.upsert_requests(self._dialect)
        self._mark_stmt = statements.mark_requests(self._dialect)
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._retry = Retrier(url, retry_max_s=retry_max_s, held=lambda: len(self._queue))
        self._queue: deque[_Pending] = deque()
        self._queued_terminal: dict[str, _Pending] = {}
        self._marks: list[_Mark] = []
        self._mark_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._closing = False
        self._closed = False
        self.write_latency = Latency()
        self.records_written = 0
        self._task = asyncio.create_task(self._write_loop(), name="ledger-writer")
        self._task.add_done_callback(self._writer_done)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        batch_size: int = 256,
        flush_interval_s: float = 0.05,
        timeout_s: float = 10.0,
        retry_max_s: float = 5.0,
    ) -> LedgerStore:
        """Connect to `url` and check its schema (SchemaError if it is not migrated).

        `flush_interval_s` is how long a batch may wait to fill up; `timeout_s` bounds
        connecting and each statement; `retry_max_s` caps the backoff between retries.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if flush_interval_s < 0 or timeout_s <= 0 or retry_max_s <= 0:
            raise ValueError("flush_interval_s must be >= 0, timeout_s and retry_max_s > 0")
        engine = open_engine(url, timeout_s=timeout_s)
        try:
            await check_schema_async(url, engine)
        except BaseException:
            await engine.dispose()
            raise
        return cls(
            engine,
            url,
            batch_size=batch_size,
            flush_interval_s=flush_interval_s,
            retry_max_s=retry_max_s,
        )

    async def __aenter__(self) -> LedgerStore:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def pending(self) -> int:
        """Records queued but not yet committed."""
        return len(self._queue)

    @property
    def errors(self) -> int:
        """Failed write attempts: transient failures and rows the database refused."""
        return self._retry.errors

    # -- requests: the batched writes ------------------------------------------------------

    def record(self, rec: RequestRecord) -> asyncio.Future[RequestRecord | None]:
        """Queue `rec`; the future resolves once it is committed (LedgerWriteError if the
        database refuses it, LedgerClosed if the store closes first). Its result: for a
        terminal `rec`, the final row as committed (the first terminal record of this id
        wins, whoever wrote it); None for the others."""
        if self._closing:
            raise LedgerClosed("the ledger store is closed")
        future: asyncio.Future[RequestRecord | None] = asyncio.get_running_loop().create_future()
        pending = _Pending(rec, future)
        self._queue.append(pending)
        if rec.terminal:
            self._queued_terminal.setdefault(rec.id, pending)
        self._wake.set()
        if len(self._queue) >= self._batch_size:
            self._full.set()
        return future

    async def mark_received(self, id: str, **fields: Any) -> RequestRecord | None:
        """Note a delivery of request `id` before running it: status 'running', attempts
        + 1 (1 for a new row), plus the given fields. Returns None to go ahead, or the
        final record if the request already reached a terminal status (then nothing is
        changed: answer from it). Awaits the commit, retrying while the database is
        unreachable; cancel it (e.g. with asyncio.timeout) to give up. LedgerWriteError
        if the database refuses this mark (its neighbours in the batch are written)."""
        if fields.keys() & {"status", "attempts"}:
            raise TypeError("mark_received sets status and attempts itself")
        if self._closing:
            raise LedgerClosed("the ledger store is closed")
        queued = self._queued_terminal.get(id)
        if queued is not None:
            # This request's final record is still being written: wait for it, so the
            # answer comes from the committed row (another delivery's outcome may win,
            # and a record the database refuses never becomes an answer).
            self._full.set()  # write it now rather than at the end of the flush interval
            with contextlib.suppress(Exception):
                await asyncio.shield(queued.future)
        given = RequestRecord(id=id, status=LedgerStatus.RUNNING, **fields)
        future: asyncio.Future[RequestRecord | None] = asyncio.get_running_loop().create_future()
        self._marks.append(_Mark(given, frozenset(fields), future))
        if self._mark_task is None or self._mark_task.done():
            self._mark_task = asyncio.create_task(self._mark_loop(), name="ledger-marks")
        return await future

    # -- one-statement operations (one attempt each) ----------------------------------------

    async def get(self, id: str) -> dict[str, Any] | None:
        """The `requests` row for `id` as a dict (timestamps aware), or None."""

        async def read(conn: AsyncConnection) -> Any:
            stmt = select(requests_table).where(requests_table.c.id == id)
            return (await conn.execute(stmt)).mappings().first()

        row = await self._once(read)
        return None if row is None else {k: aware(v) for k, v in row.items()}

    async def heartbeat(self, worker: WorkerRecord) -> None:
        """Upsert the worker's row (a missed heartbeat is harmless; the caller may
        ignore the DatabaseUnavailable)."""
        stmt = statements.upsert_worker(self._dialect, worker.row(datetime.now(UTC)))
        await self._once(lambda conn: conn.execute(stmt), write=True)

    async def cancel_unstarted(
        self, id: str, *, error: str, error_code: str
    ) -> tuple[bool, LedgerStatus | None]:
        """Make request `id` cancelled if no worker has started it (no row, or a queued
        one), so the worker that later receives its message answers from the row.
        Returns (written, its status now: None if it has no row)."""
        now = datetime.now(UTC)
        values = {
            "status": LedgerStatus.CANCELLED.value,
            "error": storable(error),
            "error_code": error_code,
            "finished_at": now,
            "updated_at": now,
        }
        stmt = statements.cancel_unstarted(self._dialect, id, values)

        async def write(conn: AsyncConnection) -> tuple[bool, LedgerStatus | None]:
            written = (await conn.execute(stmt)).first() is not None
            return written, await self._status(conn, id)

        return await self._once(write, write=True)

    async def reopen_for_replay(self, id: str) -> tuple[bool, LedgerStatus | None]:
        """Make a rejected or failed row `queued` again (error and finish cleared), so the
        dead letter replayed next runs instead of being answered from the ledger: the one
        write that reopens a final row. Returns (reopened, the status it had: None if it
        has no row)."""
        values = {"error": None, "error_code": None, "finished_at": None}
        stmt = statements.requeue_final(id, REPLAYABLE, {**values, "updated_at": datetime.now(UTC)})

        async def write(conn: AsyncConnection) -> tuple[bool, LedgerStatus | None]:
            before = await self._status(conn, id)
            return (await conn.execute(stmt)).first() is not None, before

        return await self._once(write, write=True)

    async def _status(self, conn: AsyncConnection, id: str) -> LedgerStatus | None:
        t = requests_table.c
        status = await conn.scalar(select(t.status).where(t.id == id))
        return None if status is None else LedgerStatus(status)

    async def _once(
        self, work: Callable[[AsyncConnection], Awaitable[T]], *, write: bool = False
    ) -> T:
        """`work` on a connection (in a transaction if `write`), once: DatabaseUnavailable
        if the database cannot be reached, its own error if it refuses the statement."""
        try:
            async with self._engine.begin() if write else self._engine.connect() as conn:
                result = await work(conn)
        except Exception as e:
            if is_transient(e):
                self._retry.failed(e)
                raise unreachable(self._url, e) from None
            raise
        self._retry.recovered()
        return result

    async def close(self, timeout_s: float | None = 30.0) -> int:
        """Write what is queued (waiting at most `timeout_s`), then disconnect.
        Returns the number of records left unwritten (their futures get LedgerClosed,
        as do delivery marks not yet written)."""
        if self._closed:
            return 0
        self._closing = True
        self._wake.set()
        self._full.set()
        tasks = [t for t in (self._task, self._mark_task) if t is not None and not t.done()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout_s)
            for task in late:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        left = self._fail_pending()
        self._closed = True
        await self._engine.dispose()
        if left:
            log.error(
                "ledger: closed with %d records unwritten (database at %s)",
                left,
                redact_url(self._url),
            )
        return left

    # -- the two batch loops ---------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._queue) < self._batch_size and not self._closing:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self._flush_interval_s)
            batch = list(itertools.islice(self._queue, self._batch_size))
            rows: dict[str, RequestRecord] = {}  # one per id: merged in memory
            for item in batch:
                old = rows.get(item.record.id)
                rows[item.record.id] = item.record if old is None else merge(old, item.record)
            stored, refused = await self._retry.batch(
                list(rows.values()), self._write_records, key=lambda r: r.id
            )
            for item in batch:
                self._queue.popleft()
                if self._queued_terminal.get(item.record.id) is item:
                    del self._queued_terminal[item.record.id]
                if item.future.done():  # the caller cancelled it
                    continue
                if item.record.id in refused:
                    item.future.set_exception(refused[item.record.id])
                else:
                    item.future.set_result(
                        stored.get(item.record.id) if item.record.terminal else None
                    )

    async def _write_records(self, recs: Sequence[RequestRecord]) -> dict[str, RequestRecord]:
        """Upsert `recs` in one transaction; returns the committed rows of the terminal ones."""
        start = time.perf_counter()
        now = datetime.now(UTC)
        final_ids = {r.id for r in recs if r.terminal}
        async with self._engine.begin() as conn:
            res = await conn.execute(self._upsert, [r.row(now) for r in recs])
            stored = {
                row["id"]: RequestRecord.from_row(row)
                for row in res.mappings()
                if row["id"] in final_ids
            }
        self.write_latency.observe(time.perf_counter() - start)
        self.records_written += len(recs)
        return stored

    async def _mark_loop(self) -> None:
        """Write the pending marks, many per statement: deliveries arrive in bursts, and
        one transaction per delivery would cap the worker's intake."""
        await asyncio.sleep(0)  # let the calls made in this loop iteration join
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
                    batch, self._write_marks, key=lambda m: m.record.id
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

    async def _write_marks(self, marks: Sequence[_Mark]) -> dict[str, RequestRecord]:
        """Upsert the marks in one round trip; returns the rows that were already final."""
        live = [m for m in marks if not m.future.done()]  # callers may give up meanwhile
        if not live:
            return {}
        now = datetime.now(UTC)
        rows = []
        for m in live:
            full = m.record.row(now)
            given = {k: (full[k] if k in m.fields else None) for k in MERGED}
            rows.append({**given, "id": m.record.id, "status": LedgerStatus.RUNNING.value})
            rows[-1].update(attempts=1, created_at=now, updated_at=now)
        async with self._autocommit.connect() as conn:
            # executemany with RETURNING: one compiled statement, batched by the driver.
            result = await conn.execute(self._mark_stmt, rows)
            went_ahead = {r[0] for r in result}
            final_ids = [m.record.id for m in live if m.record.id not in went_ahead]
            if not final_ids:
                return {}
            t = requests_table.c
            res = await conn.execute(select(requests_table).where(t.id.in_(final_ids)))
            return {row["id"]: RequestRecord.from_row(row) for row in res.mappings()}

    def _fail_pending(self) -> int:
        """Fail every queued record and unwritten mark with LedgerClosed; returns how many
        records there were."""
        left = len(self._queue)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    LedgerClosed(f"ledger closed before request {item.record.id} was written")
                )
        for m in self._marks:
            if not m.future.done():
                m.future.set_exception(
                    LedgerClosed(f"ledger closed before the delivery of {m.record.id} was noted")
                )
        self._queue.clear()
        self._queued_terminal.clear()
        self._marks.clear()
        return left

    def _writer_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("ledger: writer stopped", exc_info=task.exception())
            self._closing = True
            self._fail_pending()
