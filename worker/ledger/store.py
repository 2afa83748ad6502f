"""The ledger writer: every state of every request, batched into PostgreSQL (or SQLite).

`record()` queues a `RequestRecord` and returns at once; one background task writes
up to `batch_size` queued records per transaction (an `INSERT ... ON CONFLICT (id) DO
UPDATE` executemany) and then resolves their futures: for a terminal record, with the
row as the ledger holds it after the commit. That row is the request's one outcome: it
may be another delivery's, when two workers ran the same request (a redelivery after a
lost connection) and the other committed first; replies are sent from it. When the database is slow the
batches grow; when it is down the records stay queued and the task retries with capped
exponential backoff (logging once per outage), so a record is delayed, never lost,
until `close()` gives up on it.

Rules, applied by the upsert and, for several records of one id in one batch, by
`merge` in memory (so the batch holds one row per id):
- one row per id; a record sets the fields it gives and keeps the rest (None = not given);
- status moves forward only: queued -> running -> a terminal status;
- a terminal row is final: a later non-terminal record is ignored, a later terminal one
  (the same status, or even another) only touches `updated_at`;
- `attempts` never decreases; `mark_received` adds one per delivery.
Writes are therefore idempotent, which is what makes retrying a batch safe.

PostgreSQL text and JSON cannot hold U+0000, which a model may well generate (byte-level
vocabularies have a token for it) and a producer may send: text columns and metadata
strings store it as U+FFFD. `output_token_ids` stay exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, literal_column, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.ledger.migrate import (
    check_schema_async,
    describe_error,
    is_transient,
    open_engine,
    redact,
    unreachable,
)
from worker.ledger.tables import SOURCES, STATUSES, TERMINAL_STATUSES, WORKER_STATES
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

log = logging.getLogger(__name__)

_RANK = {"queued": 0, "running": 1}  # terminal statuses rank above both


class LedgerClosed(RuntimeError):
    """The store was closed (or gave up) before this record was written."""


class LedgerWriteError(ValueError):
    """The database refused this record (a constraint or type error); retrying won't help."""


def _utc(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise ValueError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return value.astimezone(UTC)


@dataclass(frozen=True)
class RequestRecord:
    """One state of one request: the `requests` columns, None meaning "not given"."""

    id: str
    status: str
    model: str | None = None
    prompt: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    output_text: str | None = None
    output_token_ids: Sequence[int] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    priority: int | None = None
    worker_id: str | None = None
    attempts: int | None = None
    enqueued_at: datetime | None = None
    received_at: datetime | None = None
    admitted_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    preemptions: int | None = None
    metadata: Mapping[str, Any] | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"request id must be a non-empty string, got {self.id!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.source is not None and self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")
        for name in _TIMESTAMPS:
            object.__setattr__(self, name, _utc(getattr(self, name), name))

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> RequestRecord:
        """The record held by a `requests` row (timestamps as aware UTC datetimes)."""
        values = {name: row[name] for name in _FIELDS}
        for name in _TIMESTAMPS:
            if values[name] is not None and values[name].tzinfo is None:  # SQLite
                values[name] = values[name].replace(tzinfo=UTC)
        return cls(**values)

    def row(self, now: datetime) -> dict[str, Any]:
        """Every column of the `requests` row, for an insert at `now`."""
        values = {name: getattr(self, name) for name in _FIELDS}
        for name in _TEXTS:
            values[name] = storable(values[name])
        if self.output_token_ids is not None:
            values["output_token_ids"] = list(self.output_token_ids)
        if self.metadata is not None:
            values["metadata"] = storable(dict(self.metadata))
        values["attempts"] = self.attempts or 0
        return {**values, "created_at": now, "updated_at": now}


_FIELDS = tuple(f.name for f in dataclass_fields(RequestRecord))
_TEXTS = ("prompt", "output_text", "error")


def storable(value: Any) -> Any:
    """`value` with U+0000 in its strings (map keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, Mapping):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


_TIMESTAMPS = tuple(name for name in _FIELDS if name.endswith("_at"))
_MERGED = tuple(name for name in _FIELDS if name not in ("id", "status", "attempts"))


def merge(old: RequestRecord, new: RequestRecord) -> RequestRecord:
    """`old` followed by `new` (same id), by the module's rules."""
    if old.terminal:
        return old
    status = new.status
    if not new.terminal and _RANK[new.status] < _RANK[old.status]:
        status = old.status
    attempts = old.attempts if new.attempts is None else max(old.attempts or 0, new.attempts)
    given = {name: v for name in _MERGED if (v := getattr(new, name)) is not None}
    return replace(old, **given, status=status, attempts=attempts)


@dataclass(frozen=True)
class WorkerRecord:
    """A worker's heartbeat: the `workers` columns (last_heartbeat None = now)."""

    id: str
    state: str
    host: str | None = None
    pid: int | None = None
    device: str | None = None
    model: str | None = None
    queue: str | None = None
    started_at: datetime | None = None
    last_heartbeat: datetime | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    tokens_per_s: float | None = None
    info: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.state not in WORKER_STATES:
            raise ValueError(f"state {self.state!r} is not one of {', '.join(WORKER_STATES)}")
        object.__setattr__(self, "started_at", _utc(self.started_at, "started_at"))
        object.__setattr__(self, "last_heartbeat", _utc(self.last_heartbeat, "last_heartbeat"))


@dataclass
class Latency:
    """A running total the metrics module reads: `count` events taking `total_s`."""

    count: int = 0
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds


@dataclass
class _Mark:
    record: RequestRecord
    fields: frozenset[str]
    future: asyncio.Future[RequestRecord | None]


@dataclass
class _Pending:
    record: RequestRecord
    future: asyncio.Future[RequestRecord | None] = field(repr=False)


def _insert(dialect: str) -> Any:
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _sql(status: str) -> ColumnElement[Any]:
    """A status as an SQL constant: the batch statement has row parameters only (an
    executemany cannot take the expanding parameter a plain in_() would make)."""
    return literal_column(f"'{status}'")


def _is_final(status: ColumnElement[Any]) -> ColumnElement[bool]:
    return status.in_([_sql(s) for s in TERMINAL_STATUSES])


def _mark_requests(dialect: str) -> Any:
    """mark_received's upsert: a new row, or 'running' with attempts + 1 unless final.
    Columns given as NULL keep their stored value."""
    stmt = _insert(dialect)(requests_table)
    t, ex = requests_table.c, stmt.excluded
    set_: dict[str, Any] = {name: func.coalesce(ex[name], t[name]) for name in _MERGED}
    set_.update(status="running", attempts=t.attempts + 1, updated_at=ex.updated_at)
    return stmt.on_conflict_do_update(
        index_elements=[t.id], set_=set_, where=~_is_final(t.status)
    ).returning(t.id)


def _upsert_requests(dialect: str) -> Any:
    """The batch upsert: one statement, executed with many parameter sets."""
    stmt = _insert(dialect)(requests_table)
    t, ex = requests_table.c, stmt.excluded
    final = _is_final(t.status)
    backwards = and_(t.status == _sql("running"), ex.status == _sql("queued"))
    set_: dict[str, Any] = {
        name: case((final, t[name]), else_=func.coalesce(ex[name], t[name])) for name in _MERGED
    }
    set_["status"] = case((final, t.status), (backwards, t.status), else_=ex.status)
    set_["attempts"] = case((ex.attempts > t.attempts, ex.attempts), else_=t.attempts)
    set_["updated_at"] = ex.updated_at
    # RETURNING: the row as it stands after the statement. A terminal record always
    # updates (keeping a final row's values), so it always gets its committed row back.
    return stmt.on_conflict_do_update(
        index_elements=[t.id], set_=set_, where=or_(~final, _is_final(ex.status))
    ).returning(*requests_table.c)


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
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._url = url
        self._dialect = engine.dialect.name
        self._upsert = _upsert_requests(self._dialect)
        self._mark_stmt = _mark_requests(self._dialect)
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._retry_max_s = retry_max_s
        self._queue: deque[_Pending] = deque()
        self._queued_terminal: dict[str, _Pending] = {}
        self._marks: list[_Mark] = []
        self._mark_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._closing = False
        self._closed = False
        self._outage_since: float | None = None
        self.write_latency = Latency()
        self.records_written = 0
        self.errors = 0
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
        unreachable; cancel it (e.g. with asyncio.timeout) to give up."""
        if fields.keys() & {"status", "attempts"}:
            raise TypeError("mark_received sets status and attempts itself")
        queued = self._queued_terminal.get(id)
        if queued is not None:
            # This request's final record is still being written: wait for it, so the
            # answer comes from the committed row (another delivery's outcome may win,
            # and a record the database refuses never becomes an answer).
            self._full.set()  # write it now rather than at the end of the flush interval
            with contextlib.suppress(Exception):
                await asyncio.shield(queued.future)
        given = RequestRecord(id=id, status="running", **fields)
        future: asyncio.Future[RequestRecord | None] = asyncio.get_running_loop().create_future()
        self._marks.append(_Mark(given, frozenset(fields), future))
        if self._mark_task is None or self._mark_task.done():
            self._mark_task = asyncio.create_task(self._mark_loop(), name="ledger-marks")
        return await future

    async def _mark_loop(self) -> None:
        """Write the pending marks, many per statement: deliveries arrive in bursts, and
        one transaction per delivery would cap the worker's intake."""
        await asyncio.sleep(0)  # let the calls made in this loop iteration join
        delay = 0.05
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
                found = await self._mark_batch(batch)
            except Exception as e:
                if not is_transient(e):
                    for m in batch:
                        if not m.future.done():
                            m.future.set_exception(e)
                    continue
                self._failed(e)
                self._marks = batch + self._marks
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            delay = 0.05
            self._recovered()
            for m in batch:
                if not m.future.done():
                    m.future.set_result(found.get(m.record.id))

    async def _mark_batch(self, batch: list[_Mark]) -> dict[str, RequestRecord]:
        """Upsert the marks in one round trip; returns the rows that were already final."""
        now = datetime.now(UTC)
        rows = []
        for m in batch:
            full = m.record.row(now)
            given = {k: (full[k] if k in m.fields else None) for k in _MERGED}
            rows.append(
                {
                    **given,
                    "id": m.record.id,
                    "status": "running",
                    "attempts": 1,
                    "created_at": now,
                    "updated_at": now,
                }
            )
        t = requests_table.c
        # Autocommit: the upsert is one atomic statement, and BEGIN and COMMIT would be
        # two more round trips per batch (a batch is often one delivery).
        async with self._autocommit.connect() as conn:
            # executemany with RETURNING: one compiled statement, batched by the driver.
            result = await conn.execute(self._mark_stmt, rows)
            went_ahead = {r[0] for r in result}
            final_ids = [m.record.id for m in batch if m.record.id not in went_ahead]
            if not final_ids:
                return {}
            res = await conn.execute(select(requests_table).where(t.id.in_(final_ids)))
            return {row["id"]: RequestRecord.from_row(row) for row in res.mappings()}

    async def get(self, id: str) -> dict[str, Any] | None:
        """The `requests` row for `id` as a dict, or None. One attempt:
        DatabaseUnavailable if the database cannot be reached."""
        try:
            async with self._engine.connect() as conn:
                stmt = select(requests_table).where(requests_table.c.id == id)
                row = (await conn.execute(stmt)).mappings().first()
        except Exception as e:
            if is_transient(e):
                raise unreachable(self._url, e) from None
            raise
        if row is None:
            return None
        out = dict(row)
        for name in (*_TIMESTAMPS, "created_at", "updated_at"):
            if out[name] is not None and out[name].tzinfo is None:  # SQLite
                out[name] = out[name].replace(tzinfo=UTC)
        return out

    async def heartbeat(self, worker: WorkerRecord) -> None:
        """Upsert the worker's row. One attempt: DatabaseUnavailable if the database
        cannot be reached (a missed heartbeat is harmless; the caller may ignore it)."""
        values = {f.name: getattr(worker, f.name) for f in dataclass_fields(WorkerRecord)}
        values["last_heartbeat"] = worker.last_heartbeat or datetime.now(UTC)
        if worker.info is not None:
            values["info"] = dict(worker.info)
        stmt = _insert(self._dialect)(workers_table).values(**values)
        t = workers_table.c
        set_: dict[str, Any] = {k: stmt.excluded[k] for k in values if k != "id"}
        set_["started_at"] = func.coalesce(stmt.excluded.started_at, t.started_at)
        stmt = stmt.on_conflict_do_update(index_elements=[t.id], set_=set_)
        try:
            async with self._engine.begin() as conn:
                await conn.execute(stmt)
        except Exception as e:
            if is_transient(e):
                self._failed(e)
                raise unreachable(self._url, e) from None
            raise
        self._recovered()

    async def close(self, timeout_s: float | None = 30.0) -> int:
        """Write what is queued (waiting at most `timeout_s`), then disconnect.
        Returns the number of records left unwritten (their futures get LedgerClosed)."""
        if self._closed:
            return 0
        self._closing = True
        self._wake.set()
        self._full.set()
        if not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        left = self._fail_pending(LedgerClosed)
        self._closed = True
        await self._engine.dispose()
        if left:
            log.error(
                "ledger: closed with %d records unwritten (database at %s)",
                left,
                redact(self._url),
            )
        return left

    # -- the writer --------------------------------------------------------------------

    async def _write_loop(self) -> None:
        delay = 0.05
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
            try:
                stored, refused = await self._commit(batch)
            except Exception as e:  # transient: keep the batch queued and retry
                self._failed(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            delay = 0.05
            self._recovered()
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

    async def _commit(
        self, batch: list[_Pending]
    ) -> tuple[dict[str, RequestRecord], dict[str, Exception]]:
        """Write `batch` (one row per id) in one transaction. If the database refuses
        it, write its rows one by one to find the bad ones. Returns the committed final
        rows of the batch's terminal ids, and the refused ids' errors. Raises only
        transient errors."""
        rows: dict[str, RequestRecord] = {}
        for item in batch:
            old = rows.get(item.record.id)
            rows[item.record.id] = item.record if old is None else merge(old, item.record)
        now = datetime.now(UTC)
        try:
            return await self._execute(list(rows.values()), now), {}
        except Exception as e:
            if is_transient(e):
                raise
            log.warning(
                "ledger: a batch of %d rows was refused (%s); writing them one by one",
                len(rows),
                describe_error(e, self._url),
            )
        refused: dict[str, Exception] = {}
        stored: dict[str, RequestRecord] = {}
        for rec in rows.values():
            try:
                stored.update(await self._execute([rec], now))
            except Exception as e:
                if is_transient(e):
                    raise
                self.errors += 1
                reason = describe_error(e, self._url)
                log.error("ledger: request %s refused by the database: %s", rec.id, reason)
                refused[rec.id] = LedgerWriteError(f"ledger refused request {rec.id}: {reason}")
        return stored, refused

    async def _execute(self, recs: list[RequestRecord], now: datetime) -> dict[str, RequestRecord]:
        """Upsert `recs`; returns the committed rows of the terminal ones."""
        start = time.perf_counter()
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

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning(
                "ledger: database at %s unavailable (%s); holding %d records, retrying",
                redact(self._url),
                describe_error(exc, self._url),
                len(self._queue),
            )

    def _recovered(self) -> None:
        if self._outage_since is not None:
            down_s = time.monotonic() - self._outage_since
            self._outage_since = None
            log.warning("ledger: database at %s is back after %.1f s", redact(self._url), down_s)

    def _fail_pending(self, error: type[Exception]) -> int:
        left = len(self._queue)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    error(f"ledger closed before request {item.record.id} was written")
                )
        self._queue.clear()
        self._queued_terminal.clear()
        return left

    def _writer_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("ledger: writer stopped", exc_info=task.exception())
            self._closing = True
            self._fail_pending(LedgerClosed)
