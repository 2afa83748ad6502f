"""The ledger against the real PostgreSQL (and SQLite): migrations, the schema check,
batching, idempotency, outages and the `kvflow db` commands."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import event, func, select
from sqlalchemy.engine import Connection, Engine, make_url

from tests.integration.helpers import eventually
from worker.cli import main
from worker.ledger import (
    LedgerClosed,
    LedgerStore,
    LedgerWriteError,
    RequestRecord,
    WorkerRecord,
)
from worker.ledger.migrate import (
    VERSION_TABLE,
    SchemaError,
    check_schema,
    check_schema_async,
    current,
    head_revision,
    open_engine,
    redact,
    upgrade,
    upgrade_async,
)
from worker.ledger.tables import metadata, requests, workers

if TYPE_CHECKING:
    from tests.integration.conftest import TcpProxy

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

PASSWORD = "hunter2-secret"  # trust auth accepts any password; it must never be shown


def _uid() -> str:
    return uuid.uuid4().hex


def _with_password(url: str) -> str:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return url
    return u.set(password=PASSWORD).render_as_string(hide_password=False)


@pytest.fixture(params=["postgresql", "sqlite"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty, unmigrated database: a new PostgreSQL schema or a new SQLite file."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    make: Callable[[], str] = request.getfixturevalue("empty_schema")
    return make()


@pytest.fixture(params=["postgresql", "sqlite"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database: the session's PostgreSQL schema or a new SQLite file."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        upgrade(url)
        return url
    return str(request.getfixturevalue("database_url"))


@pytest.fixture
def upserts() -> Iterator[list[int]]:
    """Counts the statements that write rows of `requests` (one per batch: autocommitted
    multi-row upserts) on every engine in the process while the test runs."""
    seen: list[int] = []

    def on_execute(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO REQUESTS"):
            seen.append(1)

    event.listen(Engine, "before_cursor_execute", on_execute)
    yield seen
    event.remove(Engine, "before_cursor_execute", on_execute)


async def _query(url: str, fn: Callable[[Connection], Any]) -> Any:
    engine = open_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


async def _count(url: str, prefix: str) -> int:
    stmt = select(func.count()).select_from(requests).where(requests.c.id.startswith(prefix))
    return int(await _query(url, lambda c: c.execute(stmt).scalar_one()))


# -- URLs and migrations ----------------------------------------------------------------


def test_redact_hides_the_password() -> None:
    assert redact("postgresql://u:pw@h:5/db") == "postgresql://u:***@h:5/db"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert "pw" not in redact("not a url://u:pw@h")


def test_migrations_apply_from_scratch_and_are_idempotent(fresh_url: str) -> None:
    head = head_revision()
    assert current(fresh_url) is None
    assert upgrade(fresh_url) == head
    assert upgrade(fresh_url) == head
    assert current(fresh_url) == head
    assert check_schema(fresh_url) == head


async def test_a_ledger_holding_rows_upgrades_to_the_client_column(fresh_url: str) -> None:
    """Revision 0002 adds `client` to a ledger already in use: its rows stay, without a
    client; new rows record one."""
    from alembic import command
    from sqlalchemy import text

    from worker.ledger.migrate import alembic_config

    await asyncio.to_thread(command.upgrade, alembic_config(fresh_url), "0001")
    assert await asyncio.to_thread(current, fresh_url) == "0001"

    def old_row(conn: Connection) -> None:
        conn.execute(
            text(
                "INSERT INTO requests (id, status, attempts, created_at, updated_at) "
                "VALUES ('before', 'completed', 1, :t, :t)"
            ),
            {"t": datetime.now(timezone.utc)},
        )
        conn.commit()

    await _query(fresh_url, old_row)
    assert await upgrade_async(fresh_url) == head_revision()
    async with await LedgerStore.open(fresh_url, flush_interval_s=0) as store:
        await store.record(RequestRecord("after", "completed", client="svc-a"))
        before, after = await store.get("before"), await store.get("after")
    assert before is not None and before["status"] == "completed" and before["client"] is None
    assert after is not None and after["client"] == "svc-a"


async def test_migrated_schema_matches_the_tables_module(fresh_url: str) -> None:
    await upgrade_async(fresh_url)

    def diff(conn: Connection) -> list[Any]:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return list(compare_metadata(context, metadata))

    assert await _query(fresh_url, diff) == []


async def test_unmigrated_database_is_refused_with_the_upgrade_hint(fresh_url: str) -> None:
    url = _with_password(fresh_url)
    expected = "is not migrated (at revision none, need 0002): run `kvflow db upgrade`"
    with pytest.raises(SchemaError, match="kvflow db upgrade") as sync_error:
        await asyncio.to_thread(check_schema, url)
    with pytest.raises(SchemaError) as async_error:
        await check_schema_async(url)
    with pytest.raises(SchemaError) as open_error:
        await LedgerStore.open(url)
    for error in (sync_error, async_error, open_error):
        assert expected in str(error.value)
        assert str(error.value).startswith(f"database at {redact(url)} ")
        assert PASSWORD not in str(error.value)


# -- The store --------------------------------------------------------------------------


async def test_records_are_written_in_batches(ledger_url: str, upserts: list[int]) -> None:
    prefix = _uid()
    store = await LedgerStore.open(ledger_url)
    upserts.clear()
    futures = [
        store.record(RequestRecord(id=f"{prefix}-{i}", status="completed", output_text=str(i)))
        for i in range(1000)
    ]
    assert store.pending == 1000
    await asyncio.wait_for(asyncio.gather(*futures), 30)
    batches = len(upserts)
    assert store.pending == 0
    await store.close()
    assert batches == store.write_latency.count == 4  # ceil(1000 / 256)
    assert store.records_written == 1000
    assert await _count(ledger_url, prefix) == 1000


async def test_one_row_per_id_and_terminal_rows_are_final(ledger_url: str) -> None:
    rid = _uid()
    done = datetime.now(timezone.utc)
    async with await LedgerStore.open(ledger_url, flush_interval_s=0) as store:
        await store.record(RequestRecord(rid, "queued", model="m", prompt="hi", source="queue"))
        await store.record(RequestRecord(rid, "queued", model="m", prompt="hi", source="queue"))
        await store.record(RequestRecord(rid, "running", worker_id="w1"))
        row = await store.get(rid)
        assert row is not None
        assert (row["status"], row["model"], row["prompt"], row["worker_id"]) == (
            "running",
            "m",
            "hi",
            "w1",
        )
        await store.record(
            RequestRecord(
                rid,
                "completed",
                output_text="out",
                output_token_ids=[5, 6],
                finish_reason="stop",
                finished_at=done,
                metadata={"k": "v"},
            )
        )
        final = await store.get(rid)
        assert final is not None
        assert final["status"] == "completed"
        assert final["output_token_ids"] == [5, 6]
        assert final["metadata"] == {"k": "v"}
        assert final["finished_at"] == done
        assert final["prompt"] == "hi"  # kept: a record changes only the fields it gives

        await store.record(RequestRecord(rid, "running", worker_id="w2"))  # late
        assert await store.get(rid) == final
        await store.record(RequestRecord(rid, "failed", error="boom"))  # a second verdict
        assert {**(await store.get(rid) or {}), "updated_at": None} == {
            **final,
            "updated_at": None,
        }
        await store.record(RequestRecord(rid, "completed", output_text="again"))  # a repeat
        repeated = await store.get(rid)
        assert repeated is not None
        assert repeated["updated_at"] > final["updated_at"]
        assert {**repeated, "updated_at": None} == {**final, "updated_at": None}
    assert await _count(ledger_url, rid) == 1


async def test_records_of_one_id_in_one_batch_are_coalesced(
    ledger_url: str, upserts: list[int]
) -> None:
    a, b = _uid(), _uid()
    store = await LedgerStore.open(ledger_url, flush_interval_s=0.5)
    upserts.clear()
    futures = [
        store.record(RequestRecord(a, "queued", prompt="p", priority=3)),
        store.record(RequestRecord(b, "running", worker_id="w")),
        store.record(RequestRecord(a, "running", worker_id="w", attempts=1)),
        store.record(RequestRecord(b, "queued", prompt="late")),  # does not move b back
        store.record(RequestRecord(a, "completed", output_text="x", completion_tokens=1)),
        store.record(RequestRecord(a, "running", worker_id="late")),  # after the verdict
    ]
    await asyncio.gather(*futures)
    assert len(upserts) == 1
    row_a, row_b = await store.get(a), await store.get(b)
    await store.close()
    assert row_a is not None and row_b is not None
    assert (row_a["status"], row_a["prompt"], row_a["priority"]) == ("completed", "p", 3)
    assert (row_a["worker_id"], row_a["output_text"], row_a["attempts"]) == ("w", "x", 1)
    assert (row_b["status"], row_b["prompt"]) == ("running", "late")


async def test_a_refused_record_fails_alone(
    ledger_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = _uid()
    async with await LedgerStore.open(ledger_url, flush_interval_s=0.2) as store:
        good = [store.record(RequestRecord(f"{prefix}-{i}", "queued")) for i in range(9)]
        bad = store.record(RequestRecord(f"{prefix}-bad", "queued", metadata={"x": object()}))
        await asyncio.gather(*good)
        with pytest.raises(LedgerWriteError, match=f"{prefix}-bad"):
            await bad
        assert store.errors == 1
    assert await _count(ledger_url, prefix) == 9
    assert "writing them one by one" in caplog.text


# An integer no column takes: past PostgreSQL's int4 and SQLite's int64 alike.
TOO_BIG = 2**63


async def test_a_refused_row_fails_alone_among_records_and_among_marks(
    ledger_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One row the database refuses (an integer out of range) in a batch: only that
    record or that delivery mark fails, with LedgerWriteError; its neighbours are written."""
    prefix = _uid()
    async with await LedgerStore.open(ledger_url, flush_interval_s=0.2) as store:
        records = [store.record(RequestRecord(f"{prefix}-r{i}", "queued")) for i in range(4)]
        bad_record = store.record(RequestRecord(f"{prefix}-r-bad", "queued", priority=TOO_BIG))
        marks = [store.mark_received(f"{prefix}-m{i}", worker_id="w") for i in range(4)]
        bad_mark = store.mark_received(f"{prefix}-m-bad", worker_id="w", priority=TOO_BIG)
        got = await asyncio.wait_for(
            asyncio.gather(*records, bad_record, *marks, bad_mark, return_exceptions=True), 30
        )
        assert got[:4] == [None] * 4 and got[5:9] == [None] * 4, got
        for error, rid in ((got[4], f"{prefix}-r-bad"), (got[9], f"{prefix}-m-bad")):
            assert isinstance(error, LedgerWriteError) and rid in str(error), got
        assert store.errors == 2
        row = await store.get(f"{prefix}-m0")
        assert row is not None and (row["status"], row["attempts"]) == ("running", 1)
    assert await _count(ledger_url, prefix) == 8
    assert caplog.text.count("writing them one by one") == 2  # each batch was shared


async def test_record_resolves_to_the_committed_final_row(ledger_url: str) -> None:
    """The first terminal record of an id is the outcome; a later one from another
    delivery resolves to it (so that worker replies with what the ledger keeps)."""
    rid, other = _uid(), _uid()
    done = datetime.now(timezone.utc)
    open_a = LedgerStore.open(ledger_url, flush_interval_s=0)
    open_b = LedgerStore.open(ledger_url, flush_interval_s=0)
    async with await open_a as a, await open_b as b:
        assert await a.record(RequestRecord(rid, "running", worker_id="wa")) is None
        first = RequestRecord(rid, "completed", output_text="A", worker_id="wa", finished_at=done)
        stored = await a.record(first)
        assert stored is not None
        assert (stored.status, stored.output_text, stored.worker_id) == ("completed", "A", "wa")
        assert stored.finished_at == done

        late = RequestRecord(rid, "completed", output_text="B", worker_id="wb")
        again = await b.record(late)
        assert again is not None
        assert (again.output_text, again.worker_id, again.finished_at) == ("A", "wa", done)
        failed = await b.record(RequestRecord(rid, "failed", error="boom", worker_id="wb"))
        assert failed is not None and (failed.status, failed.output_text) == ("completed", "A")

        # several records of one id in one batch: the batch's merged outcome
        batch = [
            b.record(RequestRecord(other, "running", worker_id="wb")),
            b.record(RequestRecord(other, "cancelled", error="x", worker_id="wb")),
        ]
        got = await asyncio.gather(*batch)
        assert got[0] is None
        assert got[1] is not None and got[1].status == "cancelled"


async def test_nul_characters_are_stored_as_replacement_characters(ledger_url: str) -> None:
    """PostgreSQL text and JSON refuse U+0000; models generate it. Nothing is refused."""
    rid, other = _uid(), _uid()
    async with await LedgerStore.open(ledger_url, flush_interval_s=0) as store:
        assert (
            await store.mark_received(rid, prompt="p\x00q", metadata={"k\x00": ["v\x00", 1]})
            is None
        )
        final = await store.record(
            RequestRecord(
                rid, "completed", output_text="a\x00b", output_token_ids=[0, 1], error=None
            )
        )
        assert final is not None and final.status == "completed"
        row = await store.get(rid)
        assert row is not None
        assert (row["prompt"], row["output_text"]) == ("p\ufffdq", "a\ufffdb")
        assert row["metadata"] == {"k\ufffd": ["v\ufffd", 1]}
        assert row["output_token_ids"] == [0, 1]
        await store.record(RequestRecord(other, "failed", error="bad \x00 byte"))
        row = await store.get(other)
        assert row is not None and row["error"] == "bad \ufffd byte"


async def test_mark_received_counts_deliveries_and_returns_final_rows(ledger_url: str) -> None:
    rid, queued = _uid(), _uid()
    now = datetime.now(timezone.utc)
    async with await LedgerStore.open(ledger_url, flush_interval_s=0) as store:
        assert await store.mark_received(rid, worker_id="w1", received_at=now) is None
        row = await store.get(rid)
        assert row is not None
        assert (row["status"], row["attempts"], row["worker_id"]) == ("running", 1, "w1")
        assert row["received_at"] == now

        assert await store.mark_received(rid, worker_id="w2") is None
        row = await store.get(rid)
        assert row is not None
        assert (row["attempts"], row["worker_id"], row["received_at"]) == (2, "w2", now)

        await store.record(RequestRecord(rid, "completed", output_text="answer"))
        final = await store.mark_received(rid, worker_id="w3")
        assert final is not None
        assert (final.status, final.output_text, final.attempts) == ("completed", "answer", 2)
        row = await store.get(rid)
        assert row is not None
        assert (row["attempts"], row["worker_id"]) == (2, "w2")

        # a row first written as queued keeps what it had
        await store.record(RequestRecord(queued, "queued", enqueued_at=now, priority=1))
        assert await store.mark_received(queued, worker_id="w1") is None
        row = await store.get(queued)
        assert row is not None
        assert (row["status"], row["attempts"], row["enqueued_at"]) == ("running", 1, now)

        with pytest.raises(TypeError):
            await store.mark_received(rid, status="queued")


async def test_mark_received_waits_for_a_verdict_not_yet_committed(ledger_url: str) -> None:
    """A redelivery arriving while its request's final record is still queued is answered
    from the committed row (at once: it does not wait out the flush interval)."""
    rid, refused = _uid(), _uid()
    async with await LedgerStore.open(ledger_url, flush_interval_s=30) as store:
        future = store.record(RequestRecord(rid, "completed", output_text="soon"))
        final = await asyncio.wait_for(store.mark_received(rid), 10)
        assert future.done() and future.exception() is None
        assert final is not None and (final.status, final.output_text) == ("completed", "soon")
        row = await store.get(rid)
        assert row is not None and (row["status"], row["attempts"]) == ("completed", 0)

        # a verdict the database refuses is no answer: the delivery goes ahead
        bad = store.record(RequestRecord(refused, "completed", metadata={"x": object()}))
        assert await asyncio.wait_for(store.mark_received(refused), 10) is None
        with pytest.raises(LedgerWriteError):
            bad.result()
        row = await store.get(refused)
        assert row is not None and (row["status"], row["attempts"]) == ("running", 1)


async def test_close_flushes_pending_records(ledger_url: str) -> None:
    prefix = _uid()
    store = await LedgerStore.open(ledger_url, flush_interval_s=30)
    futures = [store.record(RequestRecord(f"{prefix}-{i}", "queued")) for i in range(50)]
    assert await store.close() == 0
    assert all(f.done() and f.exception() is None for f in futures)
    assert await _count(ledger_url, prefix) == 50
    with pytest.raises(RuntimeError, match="closed"):
        store.record(RequestRecord(_uid(), "queued"))


async def test_heartbeat_upserts_one_row_per_worker(ledger_url: str) -> None:
    wid = f"host:1:{_uid()}"
    started = datetime.now(timezone.utc) - timedelta(minutes=1)
    async with await LedgerStore.open(ledger_url) as store:
        await store.heartbeat(WorkerRecord(wid, "serving", host="h", pid=1, started_at=started))
        await store.heartbeat(WorkerRecord(wid, "draining", running=3, info={"v": 1}))
    stmt = select(workers).where(workers.c.id == wid)
    rows = await _query(ledger_url, lambda c: c.execute(stmt).all())
    assert len(rows) == 1
    (row,) = rows
    assert (row.state, row.running, row.info, row.host) == ("draining", 3, {"v": 1}, None)
    assert row.started_at.replace(tzinfo=timezone.utc) == started


# -- Outages (PostgreSQL through a TCP proxy we can break) --------------------------------


async def _proxied_store(
    database_url: str, make_proxy: Callable[[str, int], Awaitable[TcpProxy]], **kw: Any
) -> tuple[TcpProxy, str, LedgerStore]:
    target = make_url(database_url)
    proxy = await make_proxy(target.host or "127.0.0.1", target.port or 5432)
    url = target.set(host="127.0.0.1", port=proxy.port, password=PASSWORD)
    url_text = url.render_as_string(hide_password=False)
    return proxy, url_text, await LedgerStore.open(url_text, **kw)


async def test_records_survive_the_database_going_away(
    database_url: str,
    tcp_proxy: Callable[[str, int], Awaitable[TcpProxy]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix = _uid()
    proxy, url, store = await _proxied_store(
        database_url, tcp_proxy, flush_interval_s=0.01, timeout_s=2, retry_max_s=0.2
    )
    await store.record(RequestRecord(f"{prefix}-before", "completed"))
    await proxy.down()
    futures = [store.record(RequestRecord(f"{prefix}-{i}", "completed")) for i in range(300)]
    received = asyncio.create_task(store.mark_received(f"{prefix}-received"))

    async def retried() -> bool:
        return store.errors >= 2

    await eventually(retried, "the store to retry twice", timeout=20)
    assert not any(f.done() for f in futures) and not received.done()
    assert store.pending == 300

    await proxy.up()
    await asyncio.wait_for(asyncio.gather(*futures), 20)
    assert await asyncio.wait_for(received, 20) is None
    assert store.pending == 0
    assert await store.close() == 0
    assert await _count(database_url, prefix) == 302
    outages = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outages) == 1  # logged once per outage, not once per retry
    assert PASSWORD not in caplog.text and redact(url) in caplog.text


async def test_a_stalled_database_delays_but_loses_nothing(
    database_url: str, tcp_proxy: Callable[[str, int], Awaitable[TcpProxy]]
) -> None:
    prefix = _uid()
    proxy, _, store = await _proxied_store(
        database_url, tcp_proxy, flush_interval_s=0.01, timeout_s=0.5, retry_max_s=0.2
    )
    proxy.pause()
    futures = [store.record(RequestRecord(f"{prefix}-{i}", "queued")) for i in range(100)]

    async def timed_out() -> bool:  # the statement timed out and is being retried
        return store.errors >= 1

    await eventually(timed_out, "a write to time out", timeout=20)
    assert not any(f.done() for f in futures)
    proxy.resume()
    await asyncio.wait_for(asyncio.gather(*futures), 20)
    assert await store.close() == 0
    assert await _count(database_url, prefix) == 100


async def test_close_gives_up_after_its_timeout_while_the_database_is_down(
    database_url: str, tcp_proxy: Callable[[str, int], Awaitable[TcpProxy]]
) -> None:
    proxy, _, store = await _proxied_store(database_url, tcp_proxy, retry_max_s=0.1)
    await proxy.down()
    futures = [store.record(RequestRecord(_uid(), "queued")) for _ in range(20)]
    assert await store.close(timeout_s=0.5) == 20
    for f in futures:
        with pytest.raises(LedgerClosed):
            f.result()


# -- The `kvflow db` commands ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_upgrade_and_current(empty_schema: Callable[[], str]) -> None:
    url = _with_password(empty_schema())
    runner = CliRunner()
    result = runner.invoke(main, ["db", "current", "--database-url", url])
    assert result.exit_code == 1, result.output
    head = head_revision()
    assert f"revision none (head is {head})" in result.output

    result = runner.invoke(main, ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert f"upgraded from empty to revision {head}" in result.output
    result = runner.invoke(main, ["db", "upgrade"], env={"KVFLOW_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert f"up to date (revision {head})" in result.output

    result = runner.invoke(main, ["db", "current", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert f"database at {redact(url)}: revision {head} (head)" in result.output
    assert PASSWORD not in result.output


@pytest.mark.parametrize("command", ["upgrade", "current"])
def test_cli_reports_an_unreachable_database(command: str) -> None:
    port = _free_port()
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/postgres"
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "db", command, "--database-url", url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    expected = f"cannot reach the database at postgresql://postgres:***@127.0.0.1:{port}/postgres: connection refused"
    assert expected in proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr


async def test_mark_received_many_at_once_each_answered(ledger_url: str) -> None:
    """Concurrent marks are written together, and marks made while a batch is in flight
    are not lost (each caller gets its answer)."""
    ids = [_uid() for _ in range(50)]
    async with await LedgerStore.open(ledger_url, flush_interval_s=0) as store:
        await store.record(RequestRecord(ids[0], "completed", output_text="done"))
        first = asyncio.gather(*(store.mark_received(i, worker_id="w") for i in ids[:25]))
        await asyncio.sleep(0)  # the first round is in flight...
        second = asyncio.gather(*(store.mark_received(i, worker_id="w") for i in ids[25:]))
        got = await asyncio.wait_for(asyncio.gather(first, second), 30)
        results = got[0] + got[1]
        assert results[0] is not None and results[0].status == "completed"
        assert all(r is None for r in results[1:])
        again = await asyncio.wait_for(store.mark_received(ids[1], worker_id="w2"), 30)
        assert again is None
        row = await store.get(ids[1])
        assert row is not None and row["attempts"] == 2 and row["worker_id"] == "w2"
