"""What a request must satisfy to be served: one set of checks, for the front and the engine.

The request builder (`worker.builder`) applies them once, where a request enters; the
engine calls `validate` again only to protect itself from direct callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.request import InvalidInput, PromptTooLong, SamplingParams

# max_tokens when a request does not give it, by input format (None: the rest of the
# context after the prompt). Every default is clamped to what the context leaves.
QUEUE_DEFAULT_MAX_TOKENS = 256  # contract v1
CHAT_DEFAULT_MAX_TOKENS: int | None = None  # OpenAI chat completions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI completions

# The ledger stores priority in a 32-bit column.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """PromptTooLong unless a prompt this long can ever run (and leave room for a token)."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLong(
            f"the prompt has {num_prompt_tokens} tokens; this engine takes prompts "
            f"of at most {max_model_len - 1} tokens (model context / KV capacity)"
        )


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits, known once the model is loaded (checkable without it)."""

    vocab_size: int
    max_model_len: int  # prompt + output tokens a sequence may hold (model and KV bound)
    max_tokens_cap: int | None  # the operator's cap on output tokens per request

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidInput (PromptTooLong) with a user-facing message if the request
        cannot be served."""
        self.check_prompt(prompt_token_ids)
        self.check_params(params)

    def check_params(self, params: SamplingParams) -> None:
        """InvalidInput for what the engine cannot hold: output above the operator's cap,
        stop token ids outside the vocabulary."""
        self._check_cap(params.max_tokens)
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidInput(
                f"stop_token_ids entry {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """InvalidInput for an empty prompt or one outside the vocabulary; PromptTooLong
        for one that leaves no room for output."""
        if not prompt_token_ids:
            raise InvalidInput("the prompt is empty: at least one token is needed")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInput(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        check_prompt_fits(len(prompt_token_ids), self.max_model_len)

    def max_tokens(self, requested: int | None, default: int | None, num_prompt_tokens: int) -> int:
        """The output budget of a request.

        `requested` is what the request asked for: refused (InvalidInput) when it is more
        than the context leaves after the prompt, or above the operator's cap. Without
        it, `default` (None = the rest of the context) is clamped to both.
        """
        room = self.max_model_len - num_prompt_tokens
        if requested is not None:
            if requested > room:
                raise InvalidInput(
                    f"max_tokens {requested} is more than the context leaves: the prompt "
                    f"has {num_prompt_tokens} tokens of the {self.max_model_len} this "
                    f"engine holds per request, so at most {room} can be generated"
                )
            self._check_cap(requested)
            return requested
        value = room if default is None else min(default, room)
        if self.max_tokens_cap is not None:
            value = min(value, self.max_tokens_cap)
        return max(1, value)

    def _check_cap(self, max_tokens: int) -> None:
        cap = self.max_tokens_cap
        if cap is not None and max_tokens > cap:
            raise InvalidInput(f"max_tokens {max_tokens} is above this worker's cap of {cap}")


def check_priority(priority: int) -> int:
    """InvalidInput unless the priority fits what the ledger stores."""
    lo, hi = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"priority must be an integer, got {priority!r}")
    if not lo <= priority <= hi:
        raise InvalidInput(f"priority must be in [{lo}, {hi}], got {priority}")
    return priority
