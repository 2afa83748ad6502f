"""The ledger store: the one way kvflow writes the `requests` and `workers` tables.

`record()` queues a state of a request and `mark_received()` notes a delivery; both are
batched (worker/ledger/writer.py, worker/ledger/marks.py) and written through one
`Retrier` (worker/ledger/retry.py): through an outage a write is delayed, never lost,
until `close()` gives up on it, and a row the database refuses fails alone. A terminal
record resolves to the row as committed: the request's one outcome, which may be another
delivery's when two workers ran the same request and the other committed first; replies
are sent from it. The rules every write follows, and why retrying is safe, are in
worker/ledger/records.py. The other operations are one statement, one attempt each:
read a row, a worker's heartbeat, and the operators' two writes (cancel a request no
worker has started, reopen a dead letter's row for a replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from broker.redact import redact_url
from worker.ledger import statements
from worker.ledger.marks import DeliveryMarks
from worker.ledger.migrate import check_schema_async, is_transient, open_engine, unreachable
from worker.ledger.records import MERGED, RequestRecord, WorkerRecord, aware, merge, storable
from worker.ledger.retry import LedgerWriteError, Retrier
from worker.ledger.states import LedgerStatus
from worker.ledger.tables import requests as requests_table
from worker.ledger.writer import Latency, LedgerClosed, RecordWriter

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
        self._url = url
        self._dialect = engine.dialect.name
        self._retry = Retrier(url, retry_max_s=retry_max_s, held=lambda: self.pending)
        self._writer = RecordWriter(
            engine, self._retry, batch_size=batch_size, flush_interval_s=flush_interval_s
        )
        self._marks = DeliveryMarks(engine, self._retry, batch_size=batch_size)
        self._closed = False

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        batch_size: int = 256,
        flush_interval_s: float = 0.0,
        timeout_s: float = 10.0,
        retry_max_s: float = 5.0,
    ) -> LedgerStore:
        """Connect to `url` and check its schema (SchemaError if it is not migrated).

        `flush_interval_s` is how long a batch may wait to fill up (0: group commit, a
        batch is written at once and what comes meanwhile joins the next); `timeout_s` bounds
        connecting and each statement; `retry_max_s` caps the backoff between retries.
        """
        if not 1 <= batch_size <= 1000:  # one batch is one multi-row statement
            raise ValueError(f"batch_size must be between 1 and 1000, got {batch_size}")
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
        return self._writer.pending

    @property
    def write_latency(self) -> Latency:
        """Committed batch transactions and their total seconds."""
        return self._writer.write_latency

    @property
    def records_written(self) -> int:
        return self._writer.records_written

    @property
    def errors(self) -> int:
        """Failed write attempts: transient failures and rows the database refused."""
        return self._retry.errors

    # -- requests: the batched writes ------------------------------------------------------

    def record(self, rec: RequestRecord) -> asyncio.Future[RequestRecord | None]:
        """Queue `rec`; the future resolves once it is committed (LedgerWriteError if the
        database refuses it, LedgerClosed if the store closes first). Its result: for a
        terminal `rec`, the outcome the ledger keeps (the first terminal record of this
        id wins, whoever wrote it): `rec` (merged with records of its id written in the
        same batch) where its outcome was committed, else the committed row, read back
        whole; None for the others."""
        return self._writer.put(rec)

    async def mark_received(self, id: str, **fields: Any) -> RequestRecord | None:
        """Note a delivery of request `id` before running it: status 'running', attempts
        + 1 (1 for a new row), plus the given fields. Returns None to go ahead, or the
        final record if the request already reached a terminal status (then nothing is
        changed: answer from it). Awaits the commit, retrying while the database is
        unreachable; cancel it (e.g. with asyncio.timeout) to give up. LedgerWriteError
        if the database refuses this mark (its neighbours in the batch are written)."""
        if fields.keys() & {"status", "attempts"}:
            raise TypeError("mark_received sets status and attempts itself")
        verdict = self._writer.queued_verdict(id)
        if verdict is not None:
            # This request's final record is still being written: wait for it, so the
            # answer comes from the committed row (another delivery's outcome may win,
            # and a record the database refuses never becomes an answer).
            with contextlib.suppress(Exception):
                await asyncio.shield(verdict)
        return await self._marks.mark(id, fields)

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

    async def record_if_new(self, rec: RequestRecord) -> RequestRecord:
        """Write `rec` only if no delivery has taken its id up: no row yet, or a `queued`
        one (reopened for a replay); returns the row the ledger holds for the id
        afterwards (ours, or the one that was there). For a rejection of bad input: a
        malformed copy of an id must never end a valid request's row. One attempt
        (DatabaseUnavailable if the database cannot be reached)."""
        stmt = statements.insert(self._dialect)(requests_table).values(rec.row(datetime.now(UTC)))
        t = requests_table.c
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.id],
            set_={name: stmt.excluded[name] for name in (*MERGED, "status", "updated_at")},
            where=t.status == LedgerStatus.QUEUED.value,
        )
        query = select(requests_table).where(requests_table.c.id == rec.id)

        async def write(conn: AsyncConnection) -> RequestRecord:
            await conn.execute(stmt)
            row = (await conn.execute(query)).mappings().one()
            return RequestRecord.from_row(row)

        return await self._once(write, write=True)

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
        self._closed = True
        left, _ = await asyncio.gather(self._writer.close(timeout_s), self._marks.close(timeout_s))
        await self._engine.dispose()
        if left:
            log.error(
                "ledger: closed with %d records unwritten (database at %s)",
                left,
                redact_url(self._url),
            )
        return left
