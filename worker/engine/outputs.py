"""The dataclasses passed between the engine's stages.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler.update
--EngineCoreOutput--> output processor --RequestOutput--> caller (async stream, batch job)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.model.sampler import TokenLogprobs
from worker.request import FinishReason, SamplingParams, TimingSummary


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute token positions [start, start + n).

    `token_ids` and `block_ids` are read-only views valid for this step only.
    """

    request_id: str
    token_ids: Sequence[int]  # all known tokens of the request (prompt + output)
    start: int  # num_computed_tokens: position of the first token to compute
    num_new_tokens: int
    block_ids: Sequence[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.start + self.num_new_tokens == len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start >= self.num_prompt_tokens


@dataclass
class SchedulerOutput:
    """What to run in one step, and what changed in the batch membership."""

    step: int
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    # Requests ended while scheduling (deadline passed before or while running).
    finished: list[EngineCoreOutput] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the scheduled requests whose chunk reached their last token."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    forward_time_s: float  # the model's forward pass and logits
    sample_time_s: float


@dataclass
class EngineCoreOutput:
    """Per request per step: new tokens and, on the last one, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    stopped_by_token: bool = False  # the last new token is an EOS or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """What the caller of the engine sees, once per step per request that changed.

    Deltas (`delta_text`, `delta_token_ids`) concatenate to the final text and tokens.
    The last output of a request has `finished=True` and carries the full text and the
    timing summary.
    """

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text: str = ""  # the whole output text (final output only)
    token_ids: list[int] = field(default_factory=list)  # all output tokens (final only)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # this step's tokens' logprobs
    timing: TimingSummary | None = None
    error: str | None = None  # set when the request failed inside the engine


@dataclass(frozen=True)
class StepStats:
    """One engine step, for metrics and the benchmark's overhead figure."""

    step: int
    started_at: float
    batch_size: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int  # tokens generated this step
    num_waiting: int
    num_preempted: int
    kv_usage: float
    step_time_s: float  # wall time of the whole step
    forward_time_s: float  # of which the model's forward pass (incl. logits)
    sample_time_s: float  # of which sampling
    # Running totals since the engine started (metrics take differences).
    preemptions_total: int = 0
    prefix_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits_total: int = 0  # of which found
    # Per client: (prompt tokens, generated tokens) computed this step (fair sharing's
    # "service received", as it happens).
    client_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def overhead_s(self) -> float:
        """Time outside the forward pass: scheduling, inputs, sampling, detokenization."""
        return max(0.0, self.step_time_s - self.forward_time_s)
