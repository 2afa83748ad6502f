"""Every ledger row a request leaves, and its timing map, built in one place.

The queue worker and `kvflow run-batch` write the same rows through these functions:
`final_record` for a request the engine ran, `error_record` for one that ended without
running, and the contract's timing map in both directions (`timing_of` from the
engine's figures, `timing_from_record` from a ledger row).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from broker.messages import TIMING_FIELDS
from worker.engine.outputs import RequestOutput
from worker.ledger import RequestRecord, RequestSource
from worker.outcome import Outcome


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


@dataclass(frozen=True)
class Origin:
    """Who recorded a request, and what it knew of it before it ran.

    `enqueued_at` is the producer's clock: it only measures the queue delay, and is
    clamped to be no later than `received_at` (the worker's clock).
    """

    worker_id: str
    source: RequestSource
    model: str | None = None
    priority: int | None = None
    enqueued_at: float | None = None
    received_at: float | None = None
    metadata: Mapping[str, Any] | None = None
    client: str | None = None

    def __post_init__(self) -> None:
        if self.enqueued_at is not None and self.received_at is not None:
            object.__setattr__(self, "enqueued_at", min(self.enqueued_at, self.received_at))


def received_fields(origin: Origin, prompt: str | None) -> dict[str, Any]:
    """What a delivery's received mark records (`LedgerStore.mark_received`'s fields)."""
    return {
        "model": origin.model,
        "prompt": prompt,
        "priority": origin.priority,
        "worker_id": origin.worker_id,
        "enqueued_at": utc(origin.enqueued_at),
        "received_at": utc(origin.received_at),
        "metadata": origin.metadata,
        "source": origin.source,
        "client": origin.client,
    }


def timing_of(
    out: RequestOutput, enqueued_at: float | None, received_at: float | None
) -> dict[str, Any]:
    """The contract's timing map (unix seconds for *_at, seconds for *_s).

    The engine measures from the request's arrival (the worker's receive time); queue
    delay, TTFT and end to end count from the producer's enqueue time when it is known
    (it is never later than the receive time: see `Origin`).
    """
    t = out.timing
    if t is None:
        return {
            **dict.fromkeys(TIMING_FIELDS),
            "enqueued_at": enqueued_at,
            "received_at": received_at,
            "finished_at": time.time(),
            "preemptions": 0,
        }
    waited = t.arrival_at - enqueued_at if enqueued_at is not None else 0.0
    waited = max(0.0, waited)
    return {
        "enqueued_at": enqueued_at,
        "received_at": received_at,
        "admitted_at": t.admitted_at,
        "first_token_at": t.first_token_at,
        "finished_at": t.finished_at or time.time(),
        "queue_s": t.queue_s + waited,
        "ttft_s": t.ttft_s + waited if t.ttft_s is not None else None,
        "prefill_s": t.prefill_s,
        "decode_s": t.decode_s,
        "e2e_s": t.e2e_s + waited,
        "itl_mean_s": t.itl_mean_s,
        "itl_p50_s": t.itl_p50_s,
        "itl_p99_s": t.itl_p99_s,
        "preemptions": t.preemptions,
    }


def timing_from_record(rec: RequestRecord) -> dict[str, Any]:
    """The contract's timing map of a ledger row (the inverse of `final_record`'s)."""
    timing: dict[str, Any] = {}
    for name in TIMING_FIELDS:
        value = getattr(rec, name)
        timing[name] = value.timestamp() if name.endswith("_at") and value else value
    timing["preemptions"] = rec.preemptions or 0
    return timing


def final_record(
    request_id: str,
    out: RequestOutput,
    origin: Origin,
    *,
    prompt_tokens: int,
    prompt: str | None = None,
) -> RequestRecord:
    """The final row of a request the engine ran."""
    outcome = Outcome.of(out)
    timing = timing_of(out, origin.enqueued_at, origin.received_at)
    return RequestRecord(
        id=request_id,
        status=outcome.status,
        model=origin.model,
        prompt=prompt,
        prompt_tokens=out.num_prompt_tokens or prompt_tokens,
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
        output_text=out.text,
        output_token_ids=out.token_ids,
        finish_reason=str(out.finish_reason) if out.finish_reason else None,
        error=outcome.error,
        error_code=str(outcome.code) if outcome.code else None,
        priority=origin.priority,
        worker_id=origin.worker_id,
        enqueued_at=utc(timing["enqueued_at"]),
        received_at=utc(timing["received_at"]),
        admitted_at=utc(timing["admitted_at"]),
        first_token_at=utc(timing["first_token_at"]),
        finished_at=utc(timing["finished_at"]),
        queue_s=timing["queue_s"],
        ttft_s=timing["ttft_s"],
        prefill_s=timing["prefill_s"],
        decode_s=timing["decode_s"],
        e2e_s=timing["e2e_s"],
        itl_mean_s=timing["itl_mean_s"],
        itl_p50_s=timing["itl_p50_s"],
        itl_p99_s=timing["itl_p99_s"],
        preemptions=int(timing["preemptions"] or 0),
        metadata=origin.metadata,
        source=origin.source,
        client=origin.client,
    )


def error_record(request_id: str, outcome: Outcome, origin: Origin) -> RequestRecord:
    """The final row of a request that ended without running (rejected, expired,
    cancelled before it started, failed)."""
    return RequestRecord(
        id=request_id,
        status=outcome.status,
        model=origin.model,
        error=outcome.error,
        error_code=str(outcome.code) if outcome.code else None,
        priority=origin.priority,
        worker_id=origin.worker_id,
        enqueued_at=utc(origin.enqueued_at),
        received_at=utc(origin.received_at),
        finished_at=utc(time.time()),
        metadata=origin.metadata,
        source=origin.source,
        client=origin.client,
    )
