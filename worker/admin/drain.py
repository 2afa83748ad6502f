"""`kvflow drain` and `kvflow resume`: stop and restart workers' intake over the control plane.

Exit codes: 0 done; 1 a worker did not answer, refused, or did not drain in time; 2 bad usage.
"""

from __future__ import annotations

from typing import Any

import click

from broker.control import ControlCommand, ControlReply
from worker.admin import views
from worker.admin.common import AdminError, Endpoints, connection_options, endpoints, run
from worker.admin.control_client import ControlClient

# A worker's drain reply comes after its timeout plus up to 30 s of requeueing.
DRAIN_MARGIN_S = 35.0


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
        "acks": [views.reply_doc(r) for r in acks.values()],
        "drained": [views.reply_doc(r) for r in drained.values()],
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
        "acks": [views.reply_doc(r) for r in acks.values()],
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
