"""What every admin command shares: where the broker and ledger are, and the error boundary.

Settings come from flags, else the environment (`KVFLOW_AMQP_URL`, `KVFLOW_DATABASE_URL`,
`KVFLOW_QUEUE`; the exchange names follow `broker.topology.Topology`, which reads
`KVFLOW_EXCHANGE`). `run()` executes a command's coroutine and turns any failure into a
one-line `click.ClickException` (exit 1) with both URLs' passwords masked: an operator
sees "cannot reach RabbitMQ at amqp://guest:***@host:1/: connection refused", never a
traceback or a secret.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click

from broker.redact import redact_text
from broker.topology import Topology, amqp_url_from_env
from worker.ledger import migrate

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class AdminError(RuntimeError):
    """A failure the operator should read as is (no type name, no traceback)."""


@dataclass(frozen=True)
class Endpoints:
    """The broker, ledger and queue one command talks to."""

    amqp_url: str
    database_url: str
    queue: str

    @classmethod
    def from_options(
        cls, amqp_url: str | None, database_url: str | None, queue: str | None
    ) -> Endpoints:
        topo = Topology(queue=queue) if queue else Topology()
        return cls(amqp_url_from_env(amqp_url), database_url or migrate.default_url(), topo.queue)

    @property
    def topology(self) -> Topology:
        return Topology(queue=self.queue)

    def scrub(self, text: str) -> str:
        """`text` with both URLs' passwords masked."""
        return redact_text(redact_text(text, self.amqp_url), self.database_url)


def connection_options(fn: F) -> F:
    """--amqp-url, --database-url, --queue and --json, for every admin command."""
    opts = [
        click.option(
            "--amqp-url",
            envvar="KVFLOW_AMQP_URL",
            default=None,
            help="RabbitMQ URL [env KVFLOW_AMQP_URL; default amqp://guest:***@localhost:5672/].",
        ),
        click.option(
            "--database-url",
            envvar="KVFLOW_DATABASE_URL",
            default=None,
            help="Ledger database URL [env KVFLOW_DATABASE_URL].",
        ),
        click.option(
            "--queue",
            envvar="KVFLOW_QUEUE",
            default=None,
            help="Request queue [env KVFLOW_QUEUE; default kvflow.requests].",
        ),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def endpoints(kw: dict[str, Any]) -> Endpoints:
    """Pop the connection options from a command's keyword arguments."""
    try:
        return Endpoints.from_options(
            kw.pop("amqp_url", None), kw.pop("database_url", None), kw.pop("queue", None)
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def run(ends: Endpoints, coro: Coroutine[Any, Any, T], *, quiet: bool = True) -> T:
    """Run a command's coroutine; every failure becomes one clean, redacted line.

    `quiet` silences the AMQP libraries' own log lines (a failed connect would be
    logged before our message says the same in one line).
    """
    if quiet:
        for name in ("aio_pika", "aiormq"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return asyncio.run(coro)
    except (click.exceptions.Exit, click.Abort):
        raise
    except click.ClickException as e:
        raise click.ClickException(ends.scrub(e.format_message())) from None
    except KeyboardInterrupt:
        raise click.Abort() from None
    except BrokenPipeError:  # `kvflow ledger export ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise click.exceptions.Exit(1) from None
    except Exception as e:
        raise click.ClickException(ends.scrub(describe(e))) from None


def describe(exc: BaseException) -> str:
    """A one-line reason: the message of errors meant for people, else type and message."""
    plain = (AdminError, ConnectionError, migrate.SchemaError, LookupError, ValueError)
    text = str(exc).strip()
    if isinstance(exc, plain) and text:
        return text.splitlines()[0]
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no details'}"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '2h', '1d', '1w' -> seconds."""
    found = _DURATION.match(text)
    if not found:
        raise ValueError(f"not a duration: {text!r} (e.g. 30s, 5m, 2h, 1d)")
    return float(found[1]) * _UNITS[(found[2] or "s").lower()]


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """A point in time: a duration ago ('5m', '2h') or an ISO 8601 time (naive = UTC)."""
    now = now or datetime.now(UTC)
    try:
        return now - timedelta(seconds=parse_duration(text))
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (a duration ago like 5m, 2h, 1d, or ISO 8601 like "
            "2024-05-01T12:00:00+00:00)"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


class TimeParam(click.ParamType):  # type: ignore[type-arg]
    """A click parameter for `parse_time`."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            return parse_time(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
