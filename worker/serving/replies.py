"""The replies a delivery sends: deltas while it runs, then one final reply built from its outcome.

A final reply is built either from the worker's own run (`result`) or from a ledger row
(`from_record`: a redelivery answered from the ledger, or another delivery's outcome that
committed first). Logprobs travel only in replies built from a run: the ledger does not
keep them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.messages import ErrorCode, encode_delta, encode_error, encode_result
from broker.publisher import ReplyPublisher
from worker.engine.outputs import RequestOutput
from worker.ledger import LedgerStatus, RequestRecord
from worker.model.sampler import TokenLogprobs
from worker.outcome import Outcome
from worker.records import timing_from_record


@dataclass(frozen=True)
class Address:
    """Where a delivery's replies go (no reply_to: the ledger is the only answer)."""

    request_id: str
    reply_to: str | None
    correlation_id: str | None

    @property
    def wanted(self) -> bool:
        return bool(self.reply_to)


def logprobs_wire(lps: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Logprobs as the contract sends them: per token its id, logprob and the top ones."""
    return [
        {"token_id": t.token_id, "logprob": t.logprob, "top": [[i, v] for i, v in t.top]}
        for t in lps
    ]


def result_body(
    request_id: str,
    out: RequestOutput,
    record: RequestRecord,
    timing: Mapping[str, Any],
    worker_id: str,
    metadata: Mapping[str, Any] | None,
    logprobs: Sequence[TokenLogprobs] | None,
) -> bytes:
    """The final reply of a run: a result (possibly partial), or the error it ended in."""
    outcome = Outcome.of(out)
    if not outcome.is_result:
        assert outcome.code is not None
        return encode_error(request_id, outcome.code, outcome.error or "the request failed")
    return encode_result(
        request_id,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=record.finish_reason or "stop",
        prompt_tokens=record.prompt_tokens or 0,
        completion_tokens=len(out.token_ids),
        timing=timing,
        worker=worker_id,
        metadata=metadata,
        logprobs=logprobs_wire(logprobs) if logprobs is not None else None,
    )


def from_record(request_id: str, rec: RequestRecord) -> bytes:
    """The final reply for a request as its ledger row records it."""
    if rec.status in (LedgerStatus.COMPLETED, LedgerStatus.EXPIRED) and rec.output_text is not None:
        return encode_result(
            request_id,
            text=rec.output_text,
            token_ids=list(rec.output_token_ids or []),
            finish_reason=rec.finish_reason or "stop",
            prompt_tokens=rec.prompt_tokens or 0,
            completion_tokens=rec.completion_tokens or 0,
            timing=timing_from_record(rec),
            worker=rec.worker_id or "",
            metadata=rec.metadata,
        )
    code = _code_of(rec)
    return encode_error(request_id, code, rec.error or f"the request was {rec.status}")


def error_body(request_id: str, outcome: Outcome) -> bytes:
    assert outcome.code is not None
    return encode_error(request_id, outcome.code, outcome.error or "the request failed")


def _code_of(rec: RequestRecord) -> ErrorCode:
    """The error code a row records (rows written before codes were kept: by status)."""
    if rec.error_code is not None and rec.error_code in set(ErrorCode):
        return ErrorCode(rec.error_code)
    by_status: dict[str, ErrorCode] = {
        LedgerStatus.CANCELLED: ErrorCode.CANCELLED,
        LedgerStatus.EXPIRED: ErrorCode.EXPIRED,
        LedgerStatus.FAILED: ErrorCode.INTERNAL,
    }
    return by_status.get(rec.status, ErrorCode.INVALID_REQUEST)


class Replier:
    """Sends replies through the publisher; a reply nobody asked for is skipped."""

    def __init__(self, publisher: ReplyPublisher) -> None:
        self.publisher = publisher

    async def delta(self, to: Address, index: int, out: RequestOutput, logprobs: bool) -> None:
        assert to.reply_to is not None
        lps = logprobs_wire(out.logprobs or []) if logprobs else None
        body = encode_delta(to.request_id, index, out.delta_text, out.delta_token_ids, lps)
        await self.publisher.publish(to.reply_to, to.correlation_id, body)

    async def send(self, to: Address, body: bytes) -> None:
        if to.reply_to:
            await self.publisher.publish(to.reply_to, to.correlation_id or to.request_id, body)
