"""What a finished request becomes: its ledger status, error code, timing and row.

Shared by the queue worker (`worker.handler`) and `kvflow run-batch`, so the two leave
the same trail in the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from broker.messages import CANCELLED, EXPIRED, INTERNAL, TIMING_FIELDS
from worker.engine.outputs import RequestOutput
from worker.ledger.store import RequestRecord
from worker.request import FinishReason

_MESSAGES = {
    CANCELLED: "cancelled by an operator",
    EXPIRED: "the request's deadline passed before it started",
}


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


@dataclass(frozen=True)
class Outcome:
    """status: the ledger's; code: the error reply's code (None = a normal result)."""

    status: str
    code: str | None
    error: str | None

    @classmethod
    def of(cls, out: RequestOutput) -> Outcome:
        if out.error is not None:
            return cls("failed", INTERNAL, out.error)
        reason = out.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            return cls("completed", None, None)
        if reason == FinishReason.DEADLINE:
            # Expired while waiting, never started: an error. Mid-generation: a partial result.
            code = EXPIRED if not out.token_ids else None
            return cls("expired", code, _MESSAGES[EXPIRED] if code else None)
        if reason == FinishReason.ABORT:
            return cls("cancelled", CANCELLED, _MESSAGES[CANCELLED])
        return cls("failed", INTERNAL, "the request ended without a finish reason")


def timing_of(
    out: RequestOutput, enqueued_at: float | None, received_at: float | None
) -> dict[str, Any]:
    """The contract's timing map (unix seconds for *_at, seconds for *_s)."""
    t = out.timing
    return {
        "enqueued_at": enqueued_at,
        "received_at": received_at,
        "admitted_at": t.admitted_at if t else None,
        "first_token_at": t.first_token_at if t else None,
        "finished_at": t.finished_at if t and t.finished_at else time.time(),
        "queue_s": t.queue_s if t else None,
        "ttft_s": t.ttft_s if t else None,
        "prefill_s": t.prefill_s if t else None,
        "decode_s": t.decode_s if t else None,
        "e2e_s": t.e2e_s if t else None,
        "itl_mean_s": t.itl_mean_s if t else None,
        "itl_p50_s": t.itl_p50_s if t else None,
        "itl_p99_s": t.itl_p99_s if t else None,
        "preemptions": t.preemptions if t else 0,
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
    outcome: Outcome,
    timing: Mapping[str, Any],
    *,
    model: str,
    worker_id: str,
    source: str,
    prompt_tokens: int,
    prompt: str | None = None,
    priority: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> RequestRecord:
    """The request's final ledger row."""
    return RequestRecord(
        id=request_id,
        status=outcome.status,
        model=model,
        prompt=prompt,
        prompt_tokens=out.num_prompt_tokens or prompt_tokens,
        completion_tokens=len(out.token_ids),
        cached_tokens=out.num_cached_tokens,
        output_text=out.text,
        output_token_ids=out.token_ids,
        finish_reason=str(out.finish_reason) if out.finish_reason else None,
        error=outcome.error,
        error_code=outcome.code,
        priority=priority,
        worker_id=worker_id,
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
        metadata=metadata,
        source=source,
    )
