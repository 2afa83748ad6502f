"""`kvflow cancel`: skip a request still queued, or abort it where it runs.

The ledger row of a request no worker has started becomes `cancelled` (through
`LedgerStore.cancel_unstarted`), and the cancel is broadcast either way: a worker
running it aborts it at its next step, one about to receive it remembers to skip it.
Exit 1 if it had already finished.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import click

from broker.control import ALL, ControlCommand
from broker.messages import CANCELLED
from worker.admin import views
from worker.admin.common import AdminError, Endpoints, connection_options, endpoints, run
from worker.admin.control_client import ControlClient
from worker.ledger.states import LedgerStatus
from worker.ledger.store import LedgerStore

CANCEL_TEXT = "cancelled by an operator"


def _terminal(status: LedgerStatus | None) -> bool:
    return status is not None and status.terminal


async def _cancel(ends: Endpoints, rid: str, timeout: float, window: float) -> dict[str, Any]:
    until = time.monotonic() + timeout
    async with await LedgerStore.open(ends.database_url) as ledger:
        written, status = await ledger.cancel_unstarted(
            rid, error=CANCEL_TEXT, error_code=CANCELLED
        )
        doc: dict[str, Any] = {"id": rid, "ledger_written": written, "running_on": None}
        if not written and _terminal(status):
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
                row = await ledger.get(rid)
                status = None if row is None else LedgerStatus(row["status"])
                if _terminal(status) or time.monotonic() > until:
                    break
                # Aborted at its next step, the handler then records 'cancelled'; or
                # not found running: ask again (it may be between mark and start).
                await asyncio.sleep(0.1 if doc["running_on"] else 0.3)
            doc["heard_by"] = sorted(heard)
    if status == LedgerStatus.CANCELLED:
        outcome = "cancelled"
    elif _terminal(status):
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
