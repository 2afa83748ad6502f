"""The data commands: `kvflow dlq list | replay | purge` and `kvflow ledger show | stats |
export` (see `dlq` and `ledger_queries` for what they do underneath)."""

from __future__ import annotations

import csv
import json
import sys
from datetime import datetime
from typing import IO, Any

import click
from tqdm import tqdm

from broker.connection import connect
from worker.admin import dlq, views
from worker.admin.common import Endpoints, TimeParam, connection_options, endpoints, run
from worker.admin.ledger_queries import LedgerReader
from worker.ledger.store import LedgerStore
from worker.ledger.tables import requests as requests_table

# -- kvflow dlq ------------------------------------------------------------------------------


@click.group("dlq")
def dlq_group() -> None:
    """The dead-letter queue (<queue>.dead): list, replay, purge."""


async def _dlq_list(ends: Endpoints, limit: int) -> dict[str, Any]:
    connection = await connect(ends.amqp_url, name="kvflow admin")
    try:
        channel = await connection.channel()
        async with LedgerReader(ends.database_url) as ledger:
            await ledger.check()
            total, letters = await dlq.peek(channel, ends.topology, ledger, limit)
    finally:
        await connection.close()
    return {
        "queue": ends.topology.dead_letter_queue,
        "count": total,
        "shown": len(letters),
        "messages": [x.as_dict() for x in letters],
    }


@dlq_group.command("list")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@connection_options
def dlq_list(limit: int, as_json: bool, **kw: Any) -> None:
    """Show dead letters (id, why, size, age); they stay in the queue."""
    ends = endpoints(kw)
    doc = run(ends, _dlq_list(ends, limit))
    if as_json:
        views.emit_json(doc)
        return
    click.echo(f"{doc['queue']}: {doc['count']} dead letters, showing {doc['shown']}")
    if doc["messages"]:
        headers = ["id", "reason", "code", "status", "error", "bytes", "age"]
        rows = [
            [
                m["id"],
                m["reason"],
                m["error_code"],
                m["status"],
                (m["error"] or "")[:60] or None,
                m["size"],
                views.ago(m["age_s"]),
            ]
            for m in doc["messages"]
        ]
        click.echo(views.table(headers, rows))


async def _dlq_replay(ends: Endpoints, ids: set[str] | None, progress: bool) -> dict[str, Any]:
    connection = await connect(ends.amqp_url, name="kvflow admin")
    try:
        channel = await connection.channel(publisher_confirms=True)
        async with await LedgerStore.open(ends.database_url) as ledger:
            outcomes, missing = await dlq.replay(
                channel, ends.topology, ledger, ids=ids, progress=progress
            )
    finally:
        await connection.close()
    return {"replayed": [o.as_dict() for o in outcomes], "not_found": sorted(missing)}


@dlq_group.command("replay")
@click.option("--id", "ids", multiple=True, help="Request id to replay (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Replay every dead letter.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@connection_options
def dlq_replay(ids: tuple[str, ...], all_: bool, progress: bool, as_json: bool, **kw: Any) -> None:
    """Republish dead letters to the request queue (ledger row reset to queued first).

    Fix what made them fail first, or they come back here.
    """
    if bool(ids) == all_:
        raise click.UsageError("give --id ID (repeatable) or --all (exactly one)")
    ends = endpoints(kw)
    doc = run(ends, _dlq_replay(ends, set(ids) if ids else None, progress))
    failed = [o for o in doc["replayed"] if not o["replayed"]]
    if as_json:
        views.emit_json(doc)
    else:
        for o in doc["replayed"]:
            if o["replayed"]:
                reset = (
                    f"ledger {o['status_before']} -> queued"
                    if o["ledger_reset"]
                    else f"ledger {o['status_before'] or 'has no row'}"
                )
                click.echo(f"replayed {o['id']} ({reset})")
            else:
                click.echo(f"not replayed {o['id']}: {o['error']}", err=True)
        click.echo(f"{len(doc['replayed']) - len(failed)} replayed")
    problems = [str(o["id"]) for o in failed] + doc["not_found"]
    if doc["not_found"]:
        click.echo(f"not in the dead-letter queue: {', '.join(doc['not_found'])}", err=True)
    if problems:
        raise click.ClickException(f"not replayed: {', '.join(problems)}")


async def _dlq_purge(ends: Endpoints) -> int:
    connection = await connect(ends.amqp_url, name="kvflow admin")
    try:
        return await dlq.purge(await connection.channel(), ends.topology)
    finally:
        await connection.close()


@dlq_group.command("purge")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@connection_options
def dlq_purge(yes: bool, as_json: bool, **kw: Any) -> None:
    """Delete every dead letter (their ledger rows stay)."""
    ends = endpoints(kw)
    if not yes:
        if as_json or not sys.stdin.isatty():
            raise click.UsageError("purging needs --yes when not asked interactively")
        click.confirm(f"delete every message in {ends.topology.dead_letter_queue}?", abort=True)
    n = run(ends, _dlq_purge(ends))
    if as_json:
        views.emit_json({"queue": ends.topology.dead_letter_queue, "purged": n})
    else:
        click.echo(f"purged {n} dead letters from {ends.topology.dead_letter_queue}")


# -- kvflow ledger ----------------------------------------------------------------------------


@click.group("ledger")
def ledger_group() -> None:
    """The request ledger: one row, stats, export."""


async def _show(ends: Endpoints, rid: str) -> dict[str, Any] | None:
    async with LedgerReader(ends.database_url) as ledger:
        return await ledger.request(rid)


@ledger_group.command("show")
@click.argument("request_id")
@connection_options
def ledger_show(request_id: str, as_json: bool, **kw: Any) -> None:
    """Every column of one request's row."""
    ends = endpoints(kw)
    row = run(ends, _show(ends, request_id))
    if row is None:
        raise click.ClickException(f"no ledger row for request {request_id!r}")
    click.echo(views.dumps(row) if as_json else views.record_text(row))


async def _stats(ends: Endpoints, since: datetime | None, until: datetime | None) -> Any:
    async with LedgerReader(ends.database_url) as ledger:
        return await ledger.summary(since, until)


@ledger_group.command("stats")
@click.option("--since", type=TimeParam(), default=None, help="5m, 2h, 1d or ISO 8601 (UTC).")
@click.option("--until", type=TimeParam(), default=None)
@connection_options
def ledger_stats(since: datetime | None, until: datetime | None, as_json: bool, **kw: Any) -> None:
    """Counts by status, tokens, throughput, latency percentiles of finished requests."""
    ends = endpoints(kw)
    doc = run(ends, _stats(ends, since, until))
    if as_json:
        views.emit_json(doc)
    else:
        title = f"since {since:%Y-%m-%d %H:%M:%S} UTC" if since else "all time"
        click.echo(views.summary_text(doc, title))


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, datetime):
        return views.jsonable(v)
    return v


async def _export(
    ends: Endpoints,
    since: datetime,
    until: datetime | None,
    fmt: str,
    out: IO[str],
    progress: bool | None,
) -> int:
    columns = [c.name for c in requests_table.columns]
    async with LedgerReader(ends.database_url) as ledger:
        total = await ledger.count(since, until)
        show = progress if progress is not None else total >= 1000
        writer = csv.DictWriter(out, fieldnames=columns) if fmt == "csv" else None
        if writer is not None:
            writer.writeheader()
        n = 0
        with tqdm(total=total, file=sys.stderr, unit="row", desc="export", disable=not show) as bar:
            async for row in ledger.export(since, until):
                if writer is not None:
                    writer.writerow({k: _csv_value(row.get(k)) for k in columns})
                else:
                    out.write(views.dumps(row, indent=None) + "\n")
                n += 1
                bar.update(1)
    return n


@ledger_group.command("export")
@click.option("--since", type=TimeParam(), required=True, help="5m, 2h, 1d or ISO 8601 (UTC).")
@click.option("--until", type=TimeParam(), default=None)
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default="-")
@click.option("--progress/--no-progress", default=None, help="Default: on for 1,000+ rows.")
@connection_options
def ledger_export(
    since: datetime,
    until: datetime | None,
    fmt: str,
    output: str,
    progress: bool | None,
    as_json: bool,
    **kw: Any,
) -> None:
    """Write the rows that finished in [--since, --until) as JSON lines or CSV."""
    ends = endpoints(kw)
    if output == "-":
        n = run(ends, _export(ends, since, until, fmt, sys.stdout, progress))
    else:
        try:
            out = open(output, "w", encoding="utf-8", newline="")  # noqa: SIM115
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e.strerror}") from None
        with out:
            n = run(ends, _export(ends, since, until, fmt, out, progress))
        click.echo(f"exported {n} rows to {output}", err=True)
