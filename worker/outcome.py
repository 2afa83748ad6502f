"""How a request ended, typed: its ledger status, its error code and the text a user reads.

Every error text a user can see is written here, once; the queue worker and
`kvflow run-batch` both describe their outcomes with `Outcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.messages import ErrorCode
from worker.engine.outputs import RequestOutput
from worker.ledger import LedgerStatus
from worker.request import FinishReason, InvalidInput, PromptTooLong

CANCELLED_TEXT = "cancelled by an operator"
EXPIRED_TEXT = "the request's deadline passed before it started"
INTERNAL_TEXT = "internal error while serving the request (see the worker's log)"
NO_FINISH_TEXT = "the request ended without a finish reason"


def returned_text(deliveries: int) -> str:
    return (
        f"delivered {deliveries} times without an outcome (the workers serving it stopped "
        "or died each time): the queue's delivery limit is reached, it is not run again"
    )


def queue_delay_text(waited_s: float, limit_s: float) -> str:
    return (
        f"the request waited {waited_s:.1f} s in the queue, over this worker's limit of "
        f"{limit_s:g} s (--max-queue-delay): it is not run late"
    )


def crashed_alone_text(crashes: int) -> str:
    return (
        f"the engine process died while running this request alone (it was part of "
        f"{crashes} engine crashes): it is not run again"
    )


# The ledger status an error code ends in.
_STATUS_OF = {
    ErrorCode.INVALID_REQUEST: LedgerStatus.REJECTED,
    ErrorCode.PROMPT_TOO_LONG: LedgerStatus.REJECTED,
    ErrorCode.EXPIRED: LedgerStatus.EXPIRED,
    ErrorCode.CANCELLED: LedgerStatus.CANCELLED,
    ErrorCode.INTERNAL: LedgerStatus.FAILED,
}


@dataclass(frozen=True)
class Outcome:
    """status: the ledger's; code: the error reply's code (None = a normal result)."""

    status: LedgerStatus
    code: ErrorCode | None = None
    error: str | None = None

    @property
    def is_result(self) -> bool:
        """A result reply (text and tokens), possibly partial; else an error reply."""
        return self.code is None

    @classmethod
    def error_of(cls, code: ErrorCode, text: str) -> Outcome:
        """An outcome that is an error reply: status follows from the code."""
        return cls(_STATUS_OF[code], code, text)

    @classmethod
    def cancelled(cls) -> Outcome:
        return cls.error_of(ErrorCode.CANCELLED, CANCELLED_TEXT)

    @classmethod
    def expired(cls, text: str = EXPIRED_TEXT) -> Outcome:
        return cls.error_of(ErrorCode.EXPIRED, text)

    @classmethod
    def internal(cls, text: str = INTERNAL_TEXT) -> Outcome:
        return cls.error_of(ErrorCode.INTERNAL, text)

    @classmethod
    def invalid(cls, error: InvalidInput) -> Outcome:
        """Bad input, as the request builder or the engine's limits described it."""
        code = ErrorCode.PROMPT_TOO_LONG if isinstance(error, PromptTooLong) else None
        return cls.error_of(code or ErrorCode.INVALID_REQUEST, str(error))

    @classmethod
    def of(cls, out: RequestOutput) -> Outcome:
        """The outcome of a request the engine ran."""
        if out.error is not None:
            return cls.internal(out.error)
        reason = out.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            return cls(LedgerStatus.COMPLETED)
        if reason == FinishReason.DEADLINE:
            # Expired while waiting, never started: an error. Mid-generation: a partial result.
            return cls.expired() if not out.token_ids else cls(LedgerStatus.EXPIRED)
        if reason == FinishReason.ABORT:
            return cls.cancelled()
        return cls.internal(NO_FINISH_TEXT)
