"""`kvflow workers` and `kvflow status`: who serves, what waits, what the ledger saw."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from worker.admin import views
from worker.admin.common import Endpoints, connection_options, endpoints, run
from worker.admin.control_client import ControlClient
from worker.admin.ledger_queries import LedgerReader
from worker.admin.queues import queue_counts
from worker.config import parse_weights
from worker.serving.lanes import OTHER, lane_queue


async def _worker_views(
    ends: Endpoints, dead_after: float, show_all: bool, ping: float | None
) -> list[dict[str, Any]]:
    async with LedgerReader(ends.database_url) as ledger:
        rows = await ledger.workers()
    now = datetime.now(UTC)
    out = [views.worker_view(r, now, dead_after) for r in rows]
    if ping:
        async with await ControlClient.open(ends.amqp_url, ends.topology) as control:
            answers = {r.worker: r.info for r in await control.discover(None, window=ping)}
        for v in out:
            info = answers.get(str(v["worker"]))
            if info is not None:
                for k in ("state", "running", "waiting", "held", "kv_usage", "tokens_per_s"):
                    v[k] = info.get(k, v[k])
                v.update(status=v["state"], alive=True, pinged=True)
    if not show_all:
        out = [v for v in out if v["alive"] or (v["heartbeat_age_s"] or 0) < 3600]
    return out


@click.command("workers")
@connection_options
@click.option(
    "--dead-after",
    type=float,
    default=views.DEAD_AFTER_S,
    show_default=True,
    help="Seconds without a heartbeat after which a worker counts as dead.",
)
@click.option(
    "--ping", type=float, default=None, help="Also ping the workers; wait this many seconds."
)
@click.option("--all", "show_all", is_flag=True, help="Include workers gone for over an hour.")
def workers(
    as_json: bool, dead_after: float, ping: float | None, show_all: bool, **kw: Any
) -> None:
    """Every worker in the ledger: state, host, pid, device, load, last heartbeat."""
    ends = endpoints(kw)
    out = run(ends, _worker_views(ends, dead_after, show_all, ping))
    if as_json:
        views.emit_json({"workers": out})
    else:
        click.echo(views.workers_table(out))


async def _status(ends: Endpoints, minutes: float) -> dict[str, Any]:
    topo = ends.topology
    errors: list[str] = []
    doc: dict[str, Any] = {"queue": topo.queue, "dead_letter_queue": topo.dead_letter_queue}
    try:
        ready, unacked = await queue_counts(ends.amqp_url, topo.queue)
        dead, _ = await queue_counts(ends.amqp_url, topo.dead_letter_queue)
        doc["requests"] = {"ready": ready, "unacked": unacked}
        doc["dead_letters"] = dead
        doc["lanes"] = await _lanes(ends.amqp_url, topo.queue)
    except (ConnectionError, LookupError, RuntimeError) as e:
        errors.append(str(e))
    since = datetime.now(UTC) - timedelta(minutes=minutes)
    try:
        async with LedgerReader(ends.database_url) as ledger:
            rows = await ledger.workers()
            doc["ledger"] = {"minutes": minutes, **await ledger.summary(since, None)}
            doc["clients"] = await ledger.clients(since, None)
        now = datetime.now(UTC)
        doc["workers"] = [
            v for v in (views.worker_view(r, now) for r in rows) if v["status"] != "stopped"
        ]
    except Exception as e:
        errors.append(ends.scrub(str(e)))
    doc["errors"] = errors
    return doc


async def _lanes(amqp_url: str, queue: str) -> dict[str, dict[str, int]]:
    """Fair mode's lanes (the clients of KVFLOW_CLIENT_WEIGHTS, and `other`), where a
    backlog waits: ready and unacked per client, for the lanes that exist."""
    names = [name for name, _ in parse_weights(os.environ.get("KVFLOW_CLIENT_WEIGHTS", ""))]
    out: dict[str, dict[str, int]] = {}
    for client in [*names, OTHER] if names else []:
        try:
            ready, unacked = await queue_counts(amqp_url, lane_queue(queue, client))
        except LookupError:
            continue
        out[client] = {"ready": ready, "unacked": unacked}
    return out


@click.command("status")
@connection_options
@click.option("--minutes", type=float, default=5.0, show_default=True, help="Ledger window.")
def status(as_json: bool, minutes: float, **kw: Any) -> None:
    """The request and dead-letter queues, the live workers and the ledger's last minutes."""
    ends = endpoints(kw)
    doc = run(ends, _status(ends, minutes))
    if as_json:
        views.emit_json(doc)
    else:
        if "requests" in doc:
            q = doc["requests"]
            click.echo(
                f"queue {doc['queue']}: {q['ready']} ready, {q['unacked']} unacked; "
                f"dead letters: {doc['dead_letters']}"
            )
        if doc.get("lanes"):
            click.echo(
                "lanes: "
                + ", ".join(
                    f"{c} {n['ready']} ready, {n['unacked']} unacked"
                    for c, n in doc["lanes"].items()
                )
            )
        if "workers" in doc:
            live = [w for w in doc["workers"] if w["alive"]]
            click.echo(f"workers: {len(live)} live, {len(doc['workers']) - len(live)} dead")
            if doc["workers"]:
                click.echo(views.workers_table(doc["workers"]))
        if "ledger" in doc:
            click.echo(views.summary_text(doc["ledger"], f"last {minutes:g} min"))
        if doc.get("clients"):
            click.echo(views.clients_table(doc["clients"]))
    if doc["errors"]:
        raise click.ClickException("; ".join(doc["errors"]))
