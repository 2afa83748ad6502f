"""Fixtures for the integration tests, which run against the real services.

Nothing here skips: a service that is not running fails the tests that need it, with
a message that says how to start it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from worker.ledger.migrate import redact, upgrade, upgrade_async

T = TypeVar("T")


def run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh event loop in another thread, so that
    sync fixtures never touch the loop pytest-asyncio runs the tests on."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# -- PostgreSQL -------------------------------------------------------------------------

POSTGRES_URL = os.environ.get(
    "KVFLOW_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


async def _execute(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


def with_search_path(url: str, schema: str) -> str:
    """`url` with a libpq `options` that puts `schema` first on the search_path."""
    u = make_url(url).update_query_dict({"options": f"-csearch_path={schema}"})
    return u.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test database ($KVFLOW_TEST_DATABASE_URL, default the local `test`)."""
    try:
        run_in_thread(_execute(POSTGRES_URL, "SELECT 1"))
    except (OSError, asyncpg.PostgresError) as e:
        pytest.fail(
            f"PostgreSQL is not reachable at {redact(POSTGRES_URL)} ({e}): start it with "
            "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
            "or point KVFLOW_TEST_DATABASE_URL at one",
            pytrace=False,
        )
    return POSTGRES_URL


@pytest.fixture(scope="session")
def empty_schema(postgres_url: str) -> Iterator[Callable[[], str]]:
    """A factory of URLs, each selecting a new, empty schema of the test database
    (through `?options=-csearch_path=...`); every schema is dropped after the session."""
    created: list[str] = []

    def make() -> str:
        name = f"kvflow_test_{uuid.uuid4().hex[:12]}"
        run_in_thread(_execute(postgres_url, f'CREATE SCHEMA "{name}"'))
        created.append(name)
        return with_search_path(postgres_url, name)

    yield make
    drops = [f'DROP SCHEMA IF EXISTS "{name}" CASCADE' for name in created]
    if drops:
        run_in_thread(_execute(postgres_url, *drops))


@pytest.fixture(scope="session")
def database_url(empty_schema: Callable[[], str]) -> str:
    """A freshly migrated schema, shared by the session: use unique ids in each test."""
    url = empty_schema()
    upgrade(url)
    return url


# -- A TCP forwarder to simulate outages --------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:`port` to (host, target_port); a test can break it.

    `down()` stops listening (new connections are refused) and cuts open connections;
    `up()` listens again on the same port. `pause()` keeps connections open but stops
    forwarding bytes (a stalled server); `resume()` lets them flow again.
    """

    def __init__(self, host: str, target_port: int) -> None:
        self.host = host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._links: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()

    async def up(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
            self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._links):
            writer.transport.abort()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._links.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            self._links.discard(dst)
            dst.transport.abort()


@pytest.fixture
async def tcp_proxy() -> AsyncIterator[Callable[[str, int], Awaitable[TcpProxy]]]:
    """A factory of started `TcpProxy`s, all taken down after the test."""
    proxies: list[TcpProxy] = []

    async def make(host: str, port: int) -> TcpProxy:
        proxy = TcpProxy(host, port)
        await proxy.up()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        with contextlib.suppress(Exception):
            await proxy.down()


# -- RabbitMQ -----------------------------------------------------------------------------

AMQP_URL = os.environ.get("KVFLOW_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def _amqp_probe(url: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url, timeout=5)
    await connection.close()


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The test broker ($KVFLOW_TEST_AMQP_URL, default the local guest account)."""
    from broker.topology import redact_text, redact_url

    try:
        run_in_thread(_amqp_probe(AMQP_URL))
        return AMQP_URL
    except Exception as e:
        reason = redact_text(str(e) or type(e).__name__, AMQP_URL)
    pytest.fail(  # outside the except block, so the report is this message alone
        f"RabbitMQ is not reachable at {redact_url(AMQP_URL)} ({reason}): start it with "
        "`rabbitmq-server -detached` or point KVFLOW_TEST_AMQP_URL at one",
        pytrace=False,
    )


async def delete_topology(url: str, topo: Any) -> None:
    """Delete a `broker.topology.Topology`'s queues and exchanges (missing ones are fine)."""
    import aio_pika

    connection = await aio_pika.connect(url, timeout=5)
    try:
        for name in (topo.queue, topo.dead_letter_queue):
            channel = await connection.channel()
            await channel.queue_delete(name)
            await channel.close()
        for name in (topo.exchange, topo.control_exchange):
            channel = await connection.channel()
            await channel.exchange_delete(name)
            await channel.close()
    finally:
        await connection.close()


@pytest.fixture
async def rabbit_topology(amqp_url: str) -> AsyncIterator[Any]:
    """A `Topology` with unique names (test.<hex>...), deleted after the test.

    Tests that need other settings use `dataclasses.replace` on it, which keeps the names.
    """
    from broker.topology import Topology

    tag = uuid.uuid4().hex[:12]
    topo = Topology(
        queue=f"test.{tag}",
        exchange=f"test.{tag}.x",
        control_exchange=f"test.{tag}.control",
    )
    yield topo
    await delete_topology(amqp_url, topo)


@pytest.fixture
async def amqp_connection(amqp_url: str) -> AsyncIterator[Any]:
    """An aio-pika connection to the test broker, closed after the test."""
    import aio_pika

    connection = await aio_pika.connect(amqp_url, timeout=5)
    yield connection
    await connection.close()


# -- the queue worker's harness (tests/integration/harness.py) ------------------------------


@pytest.fixture
async def harness(
    amqp_url: str,
    rabbit_topology: Any,
    empty_schema: Callable[[], str],
    tmp_path: Path,
) -> AsyncIterator[Any]:
    """A `tests.integration.harness.Harness` on this test's queues and a migrated schema."""
    from tests.integration.harness import Harness

    url = empty_schema()
    await upgrade_async(url)
    h = Harness(amqp_url, rabbit_topology, url, tmp_path)
    try:
        await h.open()
        yield h
    finally:
        await h.close()


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """The tiny random-weight SmolLM2-shaped model the queue tests serve."""
    return tiny_model_dir("smollm2")
