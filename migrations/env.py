"""Alembic environment for the kvflow ledger.

Normally run by `worker.ledger.migrate`, which builds the Alembic Config in code and
hands over an open connection in `config.attributes["connection"]` (one transaction,
under an advisory lock on PostgreSQL). Run any other way, it connects by itself to
`config.attributes["url"]`, `sqlalchemy.url` or $KVFLOW_DATABASE_URL: through the
async engine (asyncpg) for PostgreSQL, a plain sync engine for SQLite. Offline mode
(`--sql`) prints the SQL instead.
"""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from alembic import context
from sqlalchemy.engine import Connection

from worker.ledger.migrate import VERSION_TABLE, async_url, default_url, open_engine
from worker.ledger.tables import metadata

config = context.config


def _url() -> str:
    return str(
        config.attributes.get("url") or config.get_main_option("sqlalchemy.url") or default_url()
    )


def run_on(connection: Connection) -> None:
    """Run the migrations on an open connection."""
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Emit the SQL for the migrations without connecting."""
    context.configure(
        url=async_url(_url()),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async(url: str) -> None:
    """Connect with the async engine and run the migrations in one transaction."""
    engine = open_engine(url, timeout_s=60.0)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(run_on)
    finally:
        await engine.dispose()


def run_online() -> None:
    """Use the connection handed over, or open one for the configured URL."""
    given = config.attributes.get("connection")
    if given is not None:
        run_on(given)
        return
    url = _url()
    u = async_url(url)
    if u.get_backend_name() != "sqlite":
        asyncio.run(run_async(url))
        return
    engine = sa.create_engine(u.set(drivername="sqlite"))
    try:
        with engine.begin() as conn:
            run_on(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
