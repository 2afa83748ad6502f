"""The batched writer of request records: queue them, commit many per transaction.

`put()` queues a `RequestRecord` and returns a future at once; one background task
takes up to `batch_size` queued records (waiting at most `flush_interval_s` for a batch
to fill), folds the records of one id into one row (`records.merge`), upserts them in
one statement (`statements.upsert_requests`: a multi-row INSERT ... ON CONFLICT, atomic on
its own, so it is autocommitted: no BEGIN and COMMIT round trips) and then resolves the
futures: for a terminal record, with the outcome the ledger holds after the commit (the
record itself, or another delivery's row that was final first).
When the database is slow the batches grow; when it is down the batch waits in the
`Retrier` and the records stay queued, delayed, never lost, until `close()` gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from broker.turns import end_of_burst
from worker.ledger import statements
from worker.ledger.records import RequestRecord, merge, same_outcome
from worker.ledger.retry import Retrier
from worker.ledger.tables import requests

log = logging.getLogger("worker.ledger.store")


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


class RecordWriter:
    """Owns the queue of records not yet committed and the task that commits them."""

    def __init__(
        self, engine: AsyncEngine, retry: Retrier, *, batch_size: int, flush_interval_s: float
    ) -> None:
        # A batch is one statement (the driver sends up to 1,000 rows as one multi-row
        # INSERT; batch_size stays below that), atomic without a transaction around it.
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._retry = retry
        self._upsert = statements.RowBatch(
            statements.upsert_requests(engine.dialect.name), engine.dialect
        )
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._queue: deque[_Pending] = deque()
        self._queued_terminal: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._closing = False
        self.write_latency = Latency()
        self.records_written = 0
        self._task = asyncio.create_task(self._loop(), name="ledger-writer")
        self._task.add_done_callback(self._done)

    @property
    def pending(self) -> int:
        """Records queued but not yet committed."""
        return len(self._queue)

    def put(self, rec: RequestRecord) -> asyncio.Future[RequestRecord | None]:
        """Queue `rec`; see `LedgerStore.record` for what its future gives."""
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

    def queued_verdict(self, id: str) -> asyncio.Future[RequestRecord | None] | None:
        """The future of `id`'s first terminal record still queued, if any; asking for it
        writes the batch now rather than at the end of the flush interval."""
        pending = self._queued_terminal.get(id)
        if pending is None:
            return None
        self._full.set()
        return pending.future

    async def close(self, timeout_s: float | None) -> int:
        """Commit what is queued (waiting at most `timeout_s`), then stop. Returns how
        many records were left unwritten (their futures get LedgerClosed)."""
        self._closing = True
        self._wake.set()
        self._full.set()
        if not self._task.done():
            _, late = await asyncio.wait([self._task], timeout=timeout_s)
            if late:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        return self._fail_pending()

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._queue) < self._batch_size and not self._closing:
                if self._flush_interval_s > 0:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), self._flush_interval_s)
                else:
                    # Group commit: write what this burst of callbacks queues (a few
                    # event-loop turns at most); what comes while it is written joins
                    # the next batch.
                    await end_of_burst()
            batch = list(itertools.islice(self._queue, self._batch_size))
            rows: dict[str, RequestRecord] = {}  # one per id: merged in memory
            for item in batch:
                old = rows.get(item.record.id)
                rows[item.record.id] = item.record if old is None else merge(old, item.record)
            stored, refused = await self._retry.batch(
                list(rows.values()), self._write, key=lambda r: r.id
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

    async def _write(self, recs: Sequence[RequestRecord]) -> dict[str, RequestRecord]:
        """Upsert `recs` in one statement; returns, for each terminal one, the record of
        the outcome the ledger keeps: the record itself where its outcome was committed
        (almost always), else the committed row, read back whole."""
        start = time.perf_counter()
        now = datetime.now(UTC)
        final = {r.id: r for r in recs if r.terminal}
        stored: dict[str, RequestRecord] = {}
        async with self._engine.connect() as conn:
            res = await self._upsert.execute(conn, [r.row(now) for r in recs])
            # Only the outcome's columns come back: the whole row (prompt, output, token
            # ids, metadata) of every record of every batch would cost the event loop
            # more than the statement itself for nothing.
            lost = []
            for row in res.mappings():
                rec = final.get(row["id"])
                if rec is None:
                    continue
                if same_outcome(row, rec):
                    stored[rec.id] = rec
                else:
                    lost.append(rec.id)
            if lost:  # another delivery's outcome came first: reply with it
                read = select(requests).where(requests.c.id.in_(lost))
                for row in (await conn.execute(read)).mappings():
                    stored[row["id"]] = RequestRecord.from_row(row)
        self.write_latency.observe(time.perf_counter() - start)
        self.records_written += len(recs)
        return stored

    def _fail_pending(self) -> int:
        left = len(self._queue)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    LedgerClosed(f"ledger closed before request {item.record.id} was written")
                )
        self._queue.clear()
        self._queued_terminal.clear()
        return left

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("ledger: writer stopped", exc_info=task.exception())
            self._closing = True
            self._fail_pending()
