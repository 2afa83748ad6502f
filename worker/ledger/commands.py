"""`kvflow db ...`: apply and inspect the ledger's migrations."""

from __future__ import annotations

import click
from sqlalchemy.exc import SQLAlchemyError

from broker.redact import redact_text, redact_url
from worker.ledger import migrate

database_url_option = click.option(
    "--database-url",
    envvar="KVFLOW_DATABASE_URL",
    default=migrate.DEFAULT_URL,
    show_default=True,
    help="postgresql://user@host:port/db or sqlite:///path (env KVFLOW_DATABASE_URL).",
)


def _fail(action: str, url: str, exc: Exception) -> click.ClickException:
    """A one-line error for `exc`, never showing the URL's password."""
    if isinstance(exc, (migrate.DatabaseUnavailable, migrate.SchemaError, ValueError)):
        return click.ClickException(redact_text(str(exc), url))
    return click.ClickException(
        f"{action} failed on {redact_url(url)}: {migrate.describe_error(exc, url)}"
    )


@click.group()
def db() -> None:
    """The request ledger's database: migrations."""


@db.command()
@database_url_option
def upgrade(database_url: str) -> None:
    """Create or migrate the ledger's tables to the newest revision."""
    try:
        before = migrate.current(database_url)
        after = migrate.upgrade(database_url)
    except (OSError, SQLAlchemyError, migrate.SchemaError, ValueError) as e:
        raise _fail("upgrade", database_url, e) from None
    where = redact_url(database_url)
    if before == after:
        click.echo(f"database at {where} is up to date (revision {after})")
    else:
        click.echo(f"database at {where} upgraded from {before or 'empty'} to revision {after}")


@db.command()
@database_url_option
def current(database_url: str) -> None:
    """Show the database's revision; exit 1 if it is not the newest."""
    try:
        revision = migrate.current(database_url)
        head = migrate.head_revision()
    except (OSError, SQLAlchemyError, migrate.SchemaError, ValueError) as e:
        raise _fail("current", database_url, e) from None
    where = redact_url(database_url)
    if revision == head:
        click.echo(f"database at {where}: revision {revision} (head)")
        return
    click.echo(f"database at {where}: revision {revision or 'none'} (head is {head})")
    raise click.exceptions.Exit(1)
