"""A request as the engine sees it: tokens, sampling parameters, status and timing.

`Request` is owned by the scheduler; other stages see it only through the dataclasses
in `worker.engine.outputs`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Upper bounds that keep one request from taking the whole engine hostage.
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64  # checked against every sampled token


class InvalidInput(ValueError):
    """A request that can never be served as given; the message tells the user why."""


class PromptTooLong(InvalidInput):
    """The prompt leaves no room for output in the model's context or the KV cache."""


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Ordered: everything after PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_DEADLINE = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(enum.StrEnum):
    """Why generation ended; the values are the OpenAI / vLLM `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_DEADLINE: FinishReason.DEADLINE,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError on creation.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those
    filters. `seed` makes the request's random choices reproducible whatever else is in
    the batch. `logprobs` is the number of top alternatives to return per token (0 =
    only the sampled token's logprob, None = no logprobs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidInput(msg)

        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                bad(f"seed must fit in 64 bits, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                bad(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters long")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, "
                f"got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t)
            if t < 0:
                bad(f"stop_token_ids must be non-negative, got {t}")
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_number(name, v)
            if not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"{name} must be an integer, got {type(v).__name__} {v!r}")


def _check_number(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidInput(f"{name} must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise InvalidInput(f"{name} must be finite, got {v!r}")


@dataclass
class RequestTiming:
    """Wall-clock instants (time.time() seconds) of one request's life.

    `arrival` is given by the caller (e.g. the broker's enqueue timestamp), so queue_s
    covers time spent in RabbitMQ as well as in the engine's waiting queue.
    """

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    preemptions: int = 0

    def summary(self) -> TimingSummary:
        end = (
            self.finished
            if self.finished is not None
            else (self.token_times[-1] if self.token_times else self.arrival)
        )
        sched = self.first_scheduled if self.first_scheduled is not None else end
        first = self.first_token if self.first_token is not None else end
        in_order = tuple(
            b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)
        )
        gaps = sorted(in_order)
        return TimingSummary(
            arrival_at=self.arrival,
            admitted_at=self.first_scheduled,
            first_token_at=self.first_token,
            finished_at=self.finished,
            queue_s=max(0.0, sched - self.arrival),
            ttft_s=max(0.0, first - self.arrival) if self.first_token is not None else None,
            prefill_s=max(0.0, first - sched) if self.first_token is not None else None,
            decode_s=max(0.0, end - first) if self.first_token is not None else None,
            e2e_s=max(0.0, end - self.arrival),
            itl_mean_s=sum(gaps) / len(gaps) if gaps else None,
            itl_p50_s=percentile(gaps, 50) if gaps else None,
            itl_p99_s=percentile(gaps, 99) if gaps else None,
            itl_max_s=gaps[-1] if gaps else None,
            preemptions=self.preemptions,
            gaps_s=in_order,
        )


@dataclass(frozen=True)
class TimingSummary:
    """Per-phase latencies of one request, in seconds (None where the phase never happened),
    and the unix instants they were measured between."""

    arrival_at: float
    admitted_at: float | None
    first_token_at: float | None
    finished_at: float | None
    queue_s: float
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    preemptions: int
    gaps_s: tuple[float, ...] = ()  # every inter-token gap, in order (for histograms)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted, non-empty sequence."""
    n = len(sorted_values)
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)


class Request:
    """One generation request inside the engine.

    Token bookkeeping follows one rule: `num_computed_tokens` catches up with
    `len(all_token_ids)`. A fresh request has computed nothing; prefill (possibly in
    chunks) and decode are both "compute the tokens not yet computed", and a token is
    sampled whenever the computed count reaches the total.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "client",
        "deadline",
        "eos_token_ids",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "sampling_params",
        "seq",
        "status",
        "timing",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float,
        priority: int = 0,
        deadline: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        client: str = "default",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.client = client  # the producer service it is accounted to (fair sharing)
        self.deadline = deadline
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        # Order of arrival at the scheduler; breaks ties between equal arrival times.
        self.seq = 0
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache on the first admission.
        self.num_cached_tokens = -1
        # Chained hashes of the request's full blocks (filled by the KV cache manager).
        self.block_hashes: list[bytes] = []
        self.timing = RequestTiming(arrival=arrival_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
