"""`kvflow scale` and `kvflow up`: a local supervisor of N workers, and asking it for more or fewer."""

from __future__ import annotations

import logging
from typing import Any

import click

from broker.control import SUPERVISOR, ControlCommand, ControlReply
from worker.admin import views
from worker.admin.common import AdminError, Endpoints, connection_options, endpoints, run
from worker.admin.control_client import ControlClient


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
        "acks": [views.reply_doc(r) for r in acks.values()],
        "done": [views.reply_doc(r) for r in done.values()],
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
