"""The dataclasses passed into and out of the sampler: one row's settings, its sampled token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.request import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    output_index: int  # tokens generated so far by this request (0 for its first token)
    prompt_token_ids: Sequence[int]  # read only; for repetition_penalty
    output_token_ids: Sequence[int]  # read only; for all three penalties
    # EOS ids + stop_token_ids, banned while output_index < params.min_tokens.
    min_tokens_stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the raw logits) for one sampled token."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first, len = params.logprobs


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
