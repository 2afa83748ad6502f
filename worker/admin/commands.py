"""The fleet commands: `kvflow workers | status | drain | resume | cancel | scale | up`.

Exit codes: 0 done; 1 failed (unreachable broker or database, a worker that did not
answer or drain in time, a request that had already finished); 2 bad usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from broker.control import ALL, SUPERVISOR, ControlCommand, ControlReply
from broker.topology import queue_counts
from worker.admin import views
from worker.admin.common import AdminError, Endpoints, connection_options, endpoints, run
from worker.admin.control_client import ControlClient
from worker.admin.ledger_queries import LedgerReader
from worker.ledger.tables import TERMINAL_STATUSES

# A worker's drain reply comes after its timeout plus up to 30 s of requeueing.
DRAIN_MARGIN_S = 35.0


def _reply(r: ControlReply) -> dict[str, Any]:
    return {
        "worker": r.worker,
        "cmd": r.cmd,
        "event": r.event,
        "ok": r.ok,
        "info": r.info,
        "error": r.error,
    }


# -- kvflow workers --------------------------------------------------------------------------


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


# -- kvflow status ---------------------------------------------------------------------------


async def _status(ends: Endpoints, minutes: float) -> dict[str, Any]:
    topo = ends.topology
    errors: list[str] = []
    doc: dict[str, Any] = {"queue": topo.queue, "dead_letter_queue": topo.dead_letter_queue}
    try:
        ready, unacked = await queue_counts(ends.amqp_url, topo.queue)
        dead, _ = await queue_counts(ends.amqp_url, topo.dead_letter_queue)
        doc["requests"] = {"ready": ready, "unacked": unacked}
        doc["dead_letters"] = dead
    except (ConnectionError, LookupError, RuntimeError) as e:
        errors.append(str(e))
    since = datetime.now(UTC) - timedelta(minutes=minutes)
    try:
        async with LedgerReader(ends.database_url) as ledger:
            rows = await ledger.workers()
            doc["ledger"] = {"minutes": minutes, **await ledger.summary(since, None)}
        now = datetime.now(UTC)
        doc["workers"] = [
            v for v in (views.worker_view(r, now) for r in rows) if v["status"] != "stopped"
        ]
    except Exception as e:
        errors.append(ends.scrub(str(e)))
    doc["errors"] = errors
    return doc


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
        if "workers" in doc:
            live = [w for w in doc["workers"] if w["alive"]]
            click.echo(f"workers: {len(live)} live, {len(doc['workers']) - len(live)} dead")
            if doc["workers"]:
                click.echo(views.workers_table(doc["workers"]))
        if "ledger" in doc:
            click.echo(views.summary_text(doc["ledger"], f"last {minutes:g} min"))
    if doc["errors"]:
        raise click.ClickException("; ".join(doc["errors"]))


# -- kvflow drain / resume --------------------------------------------------------------------


async def _targets(
    control: ControlClient, ends: Endpoints, worker: str | None, window: float
) -> list[str]:
    if worker is not None:
        return [worker]
    found = await control.discover(ends.queue, window=window)
    if not found:
        raise AdminError(
            f"no worker serving queue {ends.queue!r} answered a ping within {window:g} s"
        )
    return sorted(r.worker for r in found)


async def _command_each(
    control: ControlClient, targets: list[str], cmd: str, args: dict[str, Any], window: float
) -> tuple[dict[str, ControlCommand], dict[str, ControlReply]]:
    """Send `cmd` to each target; (commands by worker, their ack replies by worker)."""
    sent = {w: ControlCommand(cmd, target=w, args=args) for w in targets}
    for c in sent.values():
        await control.send(c)
    by_id = {c.id: w for w, c in sent.items()}

    def all_acked(got: list[ControlReply]) -> bool:
        return {by_id[r.id] for r in got if r.event == "ack"} >= set(targets)

    replies = await control.collect(by_id, timeout=window, enough=all_acked)
    acks = {by_id[r.id]: r for r in replies if r.event == "ack"}
    return sent, acks


async def _drain(
    ends: Endpoints, worker: str | None, timeout: float, exit_after: bool, window: float
) -> dict[str, Any]:
    async with await ControlClient.open(ends.amqp_url, ends.topology) as control:
        targets = await _targets(control, ends, worker, window)
        args = {"timeout": timeout, "exit": exit_after}
        sent, acks = await _command_each(control, targets, "drain", args, window)
        waiting = {sent[w].id: w for w, r in acks.items() if r.ok}

        def all_drained(got: list[ControlReply]) -> bool:
            return {r.id for r in got if r.event == "drained"} >= set(waiting)

        done = await control.collect(waiting, timeout=timeout + DRAIN_MARGIN_S, enough=all_drained)
    drained = {waiting[r.id]: r for r in done if r.event == "drained"}
    return {
        "targets": targets,
        "acks": [_reply(r) for r in acks.values()],
        "drained": [_reply(r) for r in drained.values()],
        "no_answer": [w for w in targets if w not in acks],
        "refused": [w for w, r in acks.items() if not r.ok],
        "not_drained": [w for w in waiting.values() if w not in drained],
    }


def _target(worker: str | None, all_: bool) -> None:
    if (worker is None) == (not all_):
        raise click.UsageError("give a WORKER id or --all (exactly one)")


@click.command("drain")
@click.argument("worker", required=False)
@click.option("--all", "all_", is_flag=True, help="Every worker serving the queue.")
@click.option(
    "--timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds for running requests to finish; the rest are requeued.",
)
@click.option("--exit", "exit_after", is_flag=True, help="Stop the worker once drained.")
@click.option(
    "--window", type=float, default=3.0, show_default=True, help="Seconds to wait for acks."
)
@connection_options
def drain(
    worker: str | None,
    all_: bool,
    timeout: float,
    exit_after: bool,
    window: float,
    as_json: bool,
    **kw: Any,
) -> None:
    """Stop WORKER (or --all) taking new requests; wait until each reports drained.

    Running requests finish (up to --timeout); what is left is requeued, never
    dead-lettered. `kvflow resume` undoes it.
    """
    _target(worker, all_)
    if timeout < 0:
        raise click.UsageError("--timeout must be >= 0")
    ends = endpoints(kw)
    doc = run(ends, _drain(ends, worker, timeout, exit_after, window))
    if as_json:
        views.emit_json(doc)
    else:
        if doc["drained"]:
            click.echo(views.replies_table(doc["drained"]))
        for w in doc["no_answer"]:
            click.echo(f"{w}: no answer within {window:g} s (not reached, or busy)", err=True)
        for w in doc["not_drained"]:
            click.echo(f"{w}: acknowledged but did not report drained in time", err=True)
    problems = doc["no_answer"] + doc["refused"] + doc["not_drained"]
    if problems:
        raise click.ClickException(f"not drained: {', '.join(problems)}")


async def _resume(ends: Endpoints, worker: str | None, window: float) -> dict[str, Any]:
    async with await ControlClient.open(ends.amqp_url, ends.topology) as control:
        targets = await _targets(control, ends, worker, window)
        _, acks = await _command_each(control, targets, "resume", {}, window)
    return {
        "targets": targets,
        "acks": [_reply(r) for r in acks.values()],
        "no_answer": [w for w in targets if w not in acks],
        "refused": [w for w, r in acks.items() if not r.ok],
    }


@click.command("resume")
@click.argument("worker", required=False)
@click.option("--all", "all_", is_flag=True, help="Every worker serving the queue.")
@click.option(
    "--window", type=float, default=3.0, show_default=True, help="Seconds to wait for acks."
)
@connection_options
def resume(worker: str | None, all_: bool, window: float, as_json: bool, **kw: Any) -> None:
    """Let WORKER (or --all) take new requests again after a drain."""
    _target(worker, all_)
    ends = endpoints(kw)
    doc = run(ends, _resume(ends, worker, window))
    if as_json:
        views.emit_json(doc)
    elif doc["acks"]:
        click.echo(views.replies_table(doc["acks"]))
    problems = doc["no_answer"] + doc["refused"]
    if problems:
        raise click.ClickException(f"not resumed: {', '.join(problems)}")


# -- kvflow cancel -----------------------------------------------------------------------------


async def _cancel(ends: Endpoints, rid: str, timeout: float, window: float) -> dict[str, Any]:
    until = time.monotonic() + timeout
    async with LedgerReader(ends.database_url) as ledger:
        written, row = await ledger.cancel(rid)
        doc: dict[str, Any] = {"id": rid, "ledger_written": written, "running_on": None}
        status = row["status"] if row else None
        if not written and status in TERMINAL_STATUSES:
            return {**doc, "status": status, "outcome": "already_finished"}
        # Broadcast either way: a worker may be receiving the message right now, and
        # remembering the id is what makes it skip the message when it arrives.
        try:
            control = await ControlClient.open(ends.amqp_url, ends.topology)
        except ConnectionError as e:
            if not written:
                raise
            raise AdminError(
                f"request {rid} is marked cancelled in the ledger (a worker that receives it "
                f"will skip it), but the cancel could not be broadcast: {e}"
            ) from None
        async with control:
            heard: set[str] = set()
            while True:
                if doc["running_on"] is None:
                    replies = await control.call(
                        ControlCommand("cancel", target=ALL, args={"request_id": rid}),
                        timeout=window,
                        enough=lambda got: any(r.info.get("running_here") for r in got),
                    )
                    heard |= {r.worker for r in replies}
                    here = [r.worker for r in replies if r.info.get("running_here")]
                    doc["running_on"] = here[0] if here else None
                row = await ledger.request(rid)
                status = row["status"] if row else None
                if status in TERMINAL_STATUSES or time.monotonic() > until:
                    break
                # Aborted at its next step, the handler then records 'cancelled'; or
                # not found running: ask again (it may be between mark and start).
                await asyncio.sleep(0.1 if doc["running_on"] else 0.3)
            doc["heard_by"] = sorted(heard)
    if status == "cancelled":
        outcome = "cancelled"
    elif status in TERMINAL_STATUSES:
        outcome = "already_finished"
    else:
        outcome = "pending"
    return {**doc, "status": status, "outcome": outcome}


@click.command("cancel")
@click.argument("request_id")
@click.option(
    "--timeout",
    type=float,
    default=15.0,
    show_default=True,
    help="Seconds to wait for the ledger to say cancelled.",
)
@click.option("--window", type=float, default=1.0, show_default=True, help="Seconds per broadcast.")
@connection_options
def cancel(request_id: str, timeout: float, window: float, as_json: bool, **kw: Any) -> None:
    """Cancel a request: skipped if still queued, aborted at the next step if running.

    Exit 1 if it had already finished (its status is printed).
    """
    ends = endpoints(kw)
    doc = run(ends, _cancel(ends, request_id, timeout, window))
    if as_json:
        views.emit_json(doc)
    outcome, status = doc["outcome"], doc["status"]
    if outcome == "cancelled":
        if not as_json:
            where = (
                f"aborted while running on {doc['running_on']}"
                if doc["running_on"]
                else "it had not started; workers will skip its message"
            )
            click.echo(f"request {request_id} cancelled ({where})")
        return
    if outcome == "already_finished":
        raise click.ClickException(f"request {request_id} already finished: status {status}")
    raise click.ClickException(
        f"request {request_id} is still {status} after {timeout:g} s: no worker reported "
        "running it (it may be between workers); the workers that heard the cancel will "
        "skip it when it arrives"
    )


# -- kvflow scale / up --------------------------------------------------------------------------


async def _scale(ends: Endpoints, n: int, wait: bool, window: float, timeout: float) -> Any:
    async with await ControlClient.open(ends.amqp_url, ends.topology) as control:
        cmd = ControlCommand("scale", target=SUPERVISOR, args={"workers": n, "queue": ends.queue})
        got = await control.call(cmd, timeout=window, enough=bool)
        if got:  # other supervisors of this queue: a moment longer
            got += await control.collect([cmd.id], timeout=0.5)
        acks = {r.worker: r for r in got if r.event == "ack"}
        done = {r.worker: r for r in got if r.event == "done"}
        if not acks:
            raise AdminError(
                f"no `kvflow up` supervisor for queue {ends.queue!r} answered within {window:g} s"
            )
        if wait and set(acks) - set(done):

            def finished(more: list[ControlReply]) -> bool:
                return {r.worker for r in more if r.event == "done"} | set(done) >= set(acks)

            more = await control.collect([cmd.id], timeout=timeout, enough=finished)
            done |= {r.worker: r for r in more if r.event == "done"}
    return {
        "workers": n,
        "acks": [_reply(r) for r in acks.values()],
        "done": [_reply(r) for r in done.values()],
        "not_done": sorted(set(acks) - set(done)) if wait else [],
    }


@click.command("scale")
@click.argument("n", type=click.IntRange(min=0))
@click.option("--wait/--no-wait", default=True, help="Wait until the workers started or stopped.")
@click.option(
    "--window", type=float, default=5.0, show_default=True, help="Seconds to wait for the ack."
)
@click.option("--timeout", type=float, default=300.0, show_default=True)
@connection_options
def scale(n: int, wait: bool, window: float, timeout: float, as_json: bool, **kw: Any) -> None:
    """Ask the `kvflow up` supervisor(s) of the queue to keep N workers."""
    ends = endpoints(kw)
    doc = run(ends, _scale(ends, n, wait, window, timeout))
    if as_json:
        views.emit_json(doc)
    else:
        for r in doc["done"] or doc["acks"]:
            i = r["info"]
            line = f"{r['worker']}: {i.get('from')} -> {i.get('to')} workers"
            if r["event"] == "done":
                line += f"; started {i.get('started') or []}, stopped {i.get('stopped') or []}"
            click.echo(line + (f" ({r['error']})" if r["error"] else ""))
    failed = [r["worker"] for r in doc["acks"] + doc["done"] if not r["ok"]]
    if failed or doc["not_done"]:
        raise click.ClickException(f"scale incomplete: {', '.join(failed + doc['not_done'])}")


@click.command(
    "up",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--workers",
    "n",
    type=click.IntRange(min=0),
    default=None,
    help="Workers to keep [default: one per device, else 1].",
)
@click.option("--devices", default=None, help="Comma-separated device ids, e.g. 0,1.")
@click.option(
    "--stop-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="Seconds a stopping worker may drain before it is killed.",
)
@click.option(
    "--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"])
)
@connection_options
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def up(
    n: int | None,
    devices: str | None,
    stop_timeout: float,
    log_level: str,
    as_json: bool,
    worker_args: tuple[str, ...],
    **kw: Any,
) -> None:
    """Run and supervise N local workers; `kvflow worker` options go after `--`.

    Example: kvflow up --workers 2 --devices 0,1 -- --model X --num-kv-blocks 512
    """
    from worker.admin.supervisor import Supervisor, SupervisorConfig

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ends = endpoints(kw)
    device_ids = tuple(d.strip() for d in devices.split(",")) if devices else ()
    try:
        config = SupervisorConfig(
            workers=n if n is not None else max(len(device_ids), 1),
            amqp_url=ends.amqp_url,
            queue=ends.queue,
            database_url=ends.database_url,
            devices=device_ids,
            worker_args=worker_args,
            stop_timeout_s=stop_timeout,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    raise SystemExit(run(ends, Supervisor(config).run(), quiet=False))
