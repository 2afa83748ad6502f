"""Database URLs and schema migrations for the ledger.

URLs: `postgresql://` (or `postgres://`, `postgresql+asyncpg://`) is used through
asyncpg; `sqlite:///path` (or `sqlite+aiosqlite:///path`) through sqlite3 for
migrations and aiosqlite for the store. A libpq-style `?options=-csearch_path%3Dname`
on a PostgreSQL URL is passed to the server, so a URL can select a schema.

Migrations are plain Alembic scripts in `migrations/` at the repository root (or
$KVFLOW_MIGRATIONS_DIR); the Alembic `Config` is built here, there is no alembic.ini.
PostgreSQL upgrades run in one transaction under an advisory lock, so two workers
that upgrade at once do not collide.

Every message that names a database goes through `broker.redact`: a password never
reaches a log line, an exception or the terminal.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import worker
from broker.redact import redact_text, redact_url

# The names this module gave them before redaction had one home (still importable).
redact = redact_url
scrub = redact_text
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
VERSION_TABLE = "kvflow_alembic_version"  # not "alembic_version": the database may be shared
_LOCK_KEY = 0x6B76666C6F77  # b"kvflow": serializes concurrent upgrades on PostgreSQL
_SQLITE_TRANSIENT = ("locked", "busy", "unable to open", "disk i/o")

T = TypeVar("T")


class SchemaError(RuntimeError):
    """The database's schema is not the one this code needs."""


class DatabaseUnavailable(ConnectionError):
    """The database cannot be reached (refused, timed out, unknown host, bad login...)."""


def default_url() -> str:
    """$KVFLOW_DATABASE_URL, else the local PostgreSQL's `postgres` database."""
    return os.environ.get("KVFLOW_DATABASE_URL") or DEFAULT_URL


def async_url(url: str) -> URL:
    """The URL for an async engine: postgresql+asyncpg or sqlite+aiosqlite."""
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise ValueError(f"not a database URL: {redact_url(url)}") from e
    if u.drivername in ("postgresql", "postgres", "postgresql+asyncpg"):
        return u.set(drivername="postgresql+asyncpg")
    if u.drivername in ("sqlite", "sqlite+aiosqlite"):
        if not u.database or u.database == ":memory:":
            raise ValueError(
                f"{redact_url(url)}: the ledger needs a file, e.g. sqlite:///var/kvflow/ledger.db"
            )
        return u.set(drivername="sqlite+aiosqlite")
    raise ValueError(
        f"unsupported database URL {redact_url(url)}: "
        "use postgresql://, postgresql+asyncpg:// or sqlite:///path"
    )


def open_engine(url: str, *, timeout_s: float = 10.0) -> AsyncEngine:
    """An async engine for `url`; `timeout_s` bounds connecting and each statement."""
    u = async_url(url)
    if u.get_backend_name() == "sqlite":
        return create_async_engine(u, connect_args={"timeout": timeout_s})
    args: dict[str, object] = {"timeout": timeout_s, "command_timeout": timeout_s}
    options = u.query.get("options")
    if isinstance(options, str):  # libpq's `options`, sent as the startup parameter
        args["server_settings"] = {"options": options}
        u = u.difference_update_query(["options"])
    # No pre-ping: it costs a round trip per transaction, and the store retries
    # transient errors (a stale pooled connection is one) anyway.
    return create_async_engine(
        u, pool_size=10, max_overflow=20, pool_recycle=600, connect_args=args
    )


def describe_error(exc: BaseException, url: str | URL) -> str:
    """A one-line, password-free reason for a database error."""
    if isinstance(exc, ConnectionRefusedError):
        reason = "connection refused"
    elif isinstance(exc, socket.gaierror):
        reason = f"unknown host ({exc.strerror})"
    elif isinstance(exc, TimeoutError):
        reason = "timed out"
    elif isinstance(exc, DBAPIError):
        reason = re.sub(r"^<class '[\w.]+'>: ", "", str(exc.orig)).strip()
    else:
        reason = str(exc).strip() or type(exc).__name__
    return redact_text(reason.splitlines()[0] if reason else type(exc).__name__, url)


def unreachable(url: str, exc: BaseException) -> DatabaseUnavailable:
    """The error to raise when connecting to `url` failed with `exc`."""
    return DatabaseUnavailable(
        f"cannot reach the database at {redact_url(url)}: {describe_error(exc, url)}"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether retrying later may succeed: the connection, not the statement, failed."""
    if isinstance(exc, (OSError, sa.exc.TimeoutError)):  # refused, reset, timeouts
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated or isinstance(exc, InterfaceError):
        return True
    sqlstate = str(getattr(exc.orig, "sqlstate", None) or "")
    if sqlstate[:2] in ("08", "53", "57") or sqlstate in ("40001", "40P01"):
        return True  # connection exception, resources, shutdown, serialization/deadlock
    message = str(exc.orig).lower()
    return isinstance(exc, OperationalError) and any(m in message for m in _SQLITE_TRANSIENT)


def migrations_dir() -> Path:
    """$KVFLOW_MIGRATIONS_DIR, else `migrations/` next to the `worker` package."""
    env = os.environ.get("KVFLOW_MIGRATIONS_DIR")
    path = Path(env) if env else Path(worker.__file__).resolve().parents[1] / "migrations"
    if not (path / "env.py").is_file():
        raise FileNotFoundError(
            f"no Alembic migrations at {path} (env.py missing): "
            "set KVFLOW_MIGRATIONS_DIR to kvflow's migrations directory"
        )
    return path


def alembic_config(url: str | None = None) -> Config:
    """The Alembic configuration, built in code. `url` is for env.py run on its own."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    if url is not None:
        cfg.attributes["url"] = url
    return cfg


def head_revision() -> str:
    """The newest revision among the migration scripts."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise SchemaError(f"no migration scripts in {migrations_dir()}")
    return head


def _revision(conn: Connection) -> str | None:
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def _upgrade(conn: Connection, url: str) -> str | None:
    cfg = alembic_config(url)
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "head")
    return _revision(conn)


async def _run_async(url: str, fn: Callable[[Connection, str], T], *, lock: bool) -> T:
    engine = open_engine(url, timeout_s=60.0)
    try:
        try:
            conn = await engine.connect()
        except (OSError, DBAPIError, sa.exc.TimeoutError) as e:
            raise unreachable(url, e) from None
        try:
            async with conn.begin():
                if lock and engine.dialect.name == "postgresql":
                    await conn.execute(
                        sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY}
                    )
                return await conn.run_sync(fn, url)
        finally:
            await conn.close()
    finally:
        await engine.dispose()


def _run(url: str, fn: Callable[[Connection, str], T], *, lock: bool) -> T:
    """Run `fn(connection, url)` in one transaction: sync for SQLite, async otherwise."""
    u = async_url(url)
    if u.get_backend_name() != "sqlite":
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop running: the normal case for a sync caller
            return asyncio.run(_run_async(url, fn, lock=lock))
        raise RuntimeError(
            "this ledger.migrate function is synchronous; from async code use "
            "upgrade_async / check_schema_async (or asyncio.to_thread)"
        )
    engine = sa.create_engine(u.set(drivername="sqlite"), connect_args={"timeout": 60.0})
    try:
        try:
            conn = engine.connect()
        except DBAPIError as e:
            raise unreachable(url, e) from None
        with conn, conn.begin():
            return fn(conn, url)
    finally:
        engine.dispose()


def upgrade(url: str) -> str:
    """Apply every pending migration; returns the revision the database is now at."""
    revision = _run(url, _upgrade, lock=True)
    if revision is None:  # pragma: no cover - Alembic always stamps
        raise SchemaError(f"upgrade of {redact_url(url)} left no revision")
    return revision


async def upgrade_async(url: str) -> str:
    """`upgrade` from async code (runs in a thread with its own event loop)."""
    return await asyncio.to_thread(upgrade, url)


def current(url: str) -> str | None:
    """The database's revision, or None if it was never migrated."""
    return _run(url, lambda conn, _: _revision(conn), lock=False)


def _verdict(url: str, revision: str | None) -> str:
    need = head_revision()
    if revision == need:
        return revision
    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if revision is not None and revision not in known:
        raise SchemaError(
            f"database at {redact_url(url)} is at revision {revision}, which this kvflow does "
            f"not know (its newest is {need}): upgrade kvflow"
        )
    raise SchemaError(
        f"database at {redact_url(url)} is not migrated (at revision {revision or 'none'}, "
        f"need {need}): run `kvflow db upgrade`"
    )


def check_schema(url: str) -> str:
    """The head revision if the database is at it; SchemaError otherwise."""
    return _verdict(url, current(url))


async def check_schema_async(url: str, engine: AsyncEngine | None = None) -> str:
    """`check_schema` from async code, on `engine` if given (else a temporary one)."""
    own = engine is None
    eng = open_engine(url) if engine is None else engine
    try:
        try:
            conn = await eng.connect()
        except (OSError, DBAPIError, sa.exc.TimeoutError) as e:
            raise unreachable(url, e) from None
        try:
            revision = await conn.run_sync(_revision)
        finally:
            await conn.close()
    finally:
        if own:
            await eng.dispose()
    return _verdict(url, revision)
