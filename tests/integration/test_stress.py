"""Faults, load, hostile input and credentials, against the real RabbitMQ and PostgreSQL,
sized for CI. The scenarios live in tests/integration/stress.py; `python ops/stress/run.py
--big` runs the same ones at full size.

Every request must end exactly once: one terminal ledger row, one final reply to the
queue it named (a durable quorum queue here, so replies survive a broker restart),
nothing dead-lettered that should have completed. RabbitMQ and PostgreSQL outages hold
the machine's service lock (stress.SERVICES_LOCK) while the service is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import msgpack
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from tests.integration import stress
from tests.integration.conftest import TcpProxy
from tests.integration.harness import LOOKAHEAD, REPO, Harness, WorkerProc
from tests.integration.helpers import eventually
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

pytestmark = pytest.mark.integration


def check(tally: stress.Tally) -> None:
    print(tally.summary())
    assert tally.clean, tally.summary()


# -- faults --


@pytest.mark.timeout(420)
async def test_rabbitmq_restart_mid_run_loses_and_repeats_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.rabbitmq_restart(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert tally.notes["workers alive"] == 2, tally.summary()
    # the outage shows: requests in flight came back redelivered, the log says why
    assert tally.notes["redelivered"] > 0, tally.summary()
    assert all(tally.notes["logs"]), tally.summary()


@pytest.mark.timeout(420)
async def test_rabbitmq_restart_in_fair_mode_loses_and_repeats_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    """Fair mode consumes through its router (worker/serving/router.py) and pulls from
    per-client lanes: both come back after the broker restarts."""
    fair = ["--policy", "fair", "--client-weights", "a=1,b=1"]
    tally = await stress.rabbitmq_restart(harness, tiny_dir, extra=fair)
    check(tally)
    assert tally.completed == tally.requests
    assert tally.notes["workers alive"] == 2, tally.summary()


@pytest.mark.timeout(420)
async def test_postgres_down_mid_run_loses_and_repeats_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.postgres_outage(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert tally.notes["workers alive"] == 2, tally.summary()
    assert all(e > 0 for e in tally.notes["write errors"]), tally.summary()
    assert all(tally.notes["logs"]), tally.summary()


@pytest.mark.timeout(420)
async def test_a_worker_killed_twice_while_another_serves_loses_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.kill_twice(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert all(k > 0 for k in tally.notes["killed while running"]), tally.summary()
    assert tally.notes["B alive"], tally.summary()
    assert tally.notes["redelivered to B"] > 0, tally.summary()


# -- load --

N_LOAD = 2000
LOAD_SEQS = 8


@pytest.mark.timeout(600)
async def test_thousands_of_short_requests_to_two_workers(harness: Harness, tiny_dir: Path) -> None:
    """Every request exactly once; each worker holds at most its window unacked; resident
    memory after warm-up (the first fifth) grows by at most 10%."""
    tally, held, mem = await stress.load(harness, tiny_dir, N_LOAD, max_num_seqs=LOAD_SEQS)
    check(tally)
    assert tally.completed == N_LOAD
    cap = LOAD_SEQS + LOOKAHEAD
    for wid in (w.id for w in mem.workers):
        assert 0 < held.max_running[wid] <= cap, tally.summary()
        assert held.max_held[wid] <= cap, tally.summary()
    growth = mem.growth(warm_from=N_LOAD // 5)
    print("rss growth after warm-up", growth)
    assert len(growth) == 2 and all(g <= 1.10 for g in growth.values()), growth


# -- hostile input --

N_FUZZ = 3000


@pytest.mark.timeout(600)
async def test_fuzzed_messages_are_each_answered_or_dead_lettered(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.fuzz(harness, tiny_dir, N_FUZZ, seed=20261130)
    check(tally)
    assert tally.notes["alive"], tally.summary()
    assert tally.rejected > N_FUZZ // 2 and tally.completed > N_FUZZ // 10, tally.summary()


# -- KV pressure --

N_KV = 200
KV_BLOCKS = 36


@pytest.mark.timeout(600)
async def test_kv_pressure_outputs_equal_an_unconstrained_run(
    harness: Harness, tiny_dir: Path
) -> None:
    """Long greedy outputs through a pool of a few dozen blocks: preemption happens, every
    output equals the run with blocks to spare, no block stays in use, resident memory
    of the last hundred is within 10% of the first hundred's."""
    expected = stress.reference_outputs(tiny_dir, N_KV)
    tally, mem, _ = await stress.kv_pressure(harness, tiny_dir, N_KV, expected, KV_BLOCKS)
    check(tally)
    assert tally.completed == N_KV
    assert tally.notes["preemptions"] > 0, tally.summary()
    assert tally.notes["kv usage at end"] == 0, tally.summary()
    growth = mem.growth(warm_from=min(100, N_KV // 2), last_from=N_KV - 100)
    print("rss growth", growth)
    assert growth and all(g <= 1.10 for g in growth.values()), growth


# -- credentials --


@dataclasses.dataclass(frozen=True)
class Account:
    user: str
    password: str


@pytest.fixture
def rabbit_account() -> Iterator[Account]:
    """A RabbitMQ user with a random password and full rights on /, deleted afterwards."""
    account = Account(f"kvflow-cred-{uuid.uuid4().hex[:8]}", "rq-" + secrets.token_urlsafe(12))
    ctl = ["rabbitmqctl", "-q"]
    subprocess.run(
        [*ctl, "add_user", account.user, account.password],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        subprocess.run(
            [*ctl, "set_permissions", "-p", "/", account.user, ".*", ".*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield account
    finally:
        subprocess.run([*ctl, "delete_user", account.user], capture_output=True, timeout=60)


@pytest.fixture
async def pg_account(harness: Harness) -> AsyncIterator[Account]:
    """A PostgreSQL login role with a random password, owning nothing, allowed to use this
    test's ledger schema; dropped afterwards. (This machine's pg_hba trusts 127.0.0.1,
    so the password is sent and not checked; where it is checked the test is the same.)"""
    account = Account(f"kvflow_cred_{uuid.uuid4().hex[:8]}", "pg-" + secrets.token_urlsafe(12))
    schema = make_url(harness.db_url).query["options"]
    schema = str(schema).split("=", 1)[1]
    async with harness.db.begin() as conn:
        await conn.execute(text(f"CREATE ROLE {account.user} LOGIN PASSWORD '{account.password}'"))
        await conn.execute(text(f'GRANT USAGE ON SCHEMA "{schema}" TO {account.user}'))
        await conn.execute(text(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO {account.user}'))
        await conn.execute(
            text(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{schema}" TO {account.user}')
        )
    try:
        yield account
    finally:
        async with harness.db.begin() as conn:
            await conn.execute(text(f"DROP OWNED BY {account.user}"))
            await conn.execute(text(f"DROP ROLE {account.user}"))


@pytest.mark.timeout(300)
async def test_passwords_in_both_urls_appear_nowhere_even_through_outages(
    harness: Harness,
    tiny_dir: Path,
    rabbit_account: Account,
    pg_account: Account,
    tcp_proxy: Callable[[str, int], Awaitable[TcpProxy]],
) -> None:
    """A worker with a password in its broker and its ledger URL, both reached through
    proxies the test breaks: the reconnect and outage messages, its metrics, the admin
    CLI (also when a service is unreachable), the ledger rows and the replies never hold
    either password. (tests/integration/test_permissions.py covers the producer/worker
    users and the CLI with a reachable broker; this adds real roles and outages.)"""
    h = harness
    broker = await tcp_proxy("127.0.0.1", 5672)
    db = await tcp_proxy("127.0.0.1", 5432)
    amqp = f"amqp://{quote(rabbit_account.user)}:{quote(rabbit_account.password)}@127.0.0.1:{broker.port}/"
    ledger = (
        make_url(h.db_url)
        .set(username=pg_account.user, password=pg_account.password, port=db.port)
        .render_as_string(hide_password=False)
    )
    port = stress.free_port()
    w = h.start(
        "cred",
        model=tiny_dir,
        max_num_seqs=2,
        amqp_url=amqp,
        database_url=ledger,
        extra=stress.metrics_args(port),
    )
    await h.ready(w)

    async def served(rid: str) -> None:
        handle = await h.client.submit(prompt_token_ids=[1, 2, 3], id=rid, max_tokens=3)
        assert (await handle.result(120))["type"] == "result"

    await served(f"cred-a-{uuid.uuid4().hex[:6]}")
    # the broker goes away: the worker reconnects, and says so
    await broker.down()
    await eventually(lambda: _says(w, "Connection attempt"), "a reconnect message", timeout=60)
    await broker.up()
    await served(f"cred-b-{uuid.uuid4().hex[:6]}")
    # the database goes away while a request finishes: the ledger outage is logged
    await db.down()
    waiting = asyncio.create_task(served(f"cred-c-{uuid.uuid4().hex[:6]}"))
    await eventually(lambda: _says(w, "unavailable"), "a ledger outage message", timeout=60)
    cli_down = await _cli(h, "status", "--json", amqp=amqp, database=ledger)
    await db.up()
    await waiting
    bad = f"cred-bad-{uuid.uuid4().hex[:6]}"  # an error reply too
    await h.publish_raw(msgpack.packb({"prompt": "hi", "max_tokens": "x"}), bad)

    async def refused() -> bool:
        return h.client.kinds(bad) == ["error"]

    await eventually(refused, "the error reply", timeout=60)

    cli = [cli_down]
    for args in (
        ("status", "--json"),
        ("workers", "--json"),
        ("ledger", "stats", "--json"),
        ("dlq", "list"),
    ):
        cli.append(await _cli(h, *args, amqp=amqp, database=ledger))
    cli.append(
        await _cli(
            h,
            "status",
            amqp=amqp.replace(str(broker.port), "1"),
            database=ledger.replace(str(db.port), "1"),
        )
    )
    metrics = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    )
    async with h.db.connect() as conn:
        rows = [str(r) for r in (await conn.execute(select(requests_table))).all()]
        rows += [str(r) for r in (await conn.execute(select(workers_table))).all()]
    replies = [str(r) for rs in h.client.replies.values() for r in rs]
    await w.stop()
    texts = {
        "worker log": w.log_path.read_text(errors="replace"),
        "metrics": metrics.decode(),
        "cli": "\n".join(cli),
        "ledger": "\n".join(rows),
        "replies": "\n".join(replies),
    }
    assert "Reconnecting" in texts["worker log"] and "is back after" in texts["worker log"]
    for where, content in texts.items():
        for secret in (rabbit_account.password, pg_account.password):
            for form in {secret, quote(secret)}:
                assert form not in content, f"a password in the {where}"


async def _says(w: WorkerProc, what: str) -> bool:
    return what in w.output()


async def _cli(h: Harness, *args: str, amqp: str, database: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env |= {
        "KVFLOW_AMQP_URL": amqp,
        "KVFLOW_DATABASE_URL": database,
        "KVFLOW_QUEUE": h.topo.queue,
        "KVFLOW_EXCHANGE": h.topo.exchange,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.cli",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return out.decode() + err.decode()
