"""Build the engine's request from either input format: one place for prompts, defaults and limits.

The queue contract's decoder (`broker.messages`) and run-batch's OpenAI body parser
(`worker.openai_format`) check the shape of what they were sent; both hand the result
here, as a `Prompt` and a map of `SamplingParams` fields, and get the same
`EngineRequest`, or an `InvalidInput` (`PromptTooLong`) whose message tells the user
what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.limits import RequestLimits, check_priority
from worker.model.tokenizer import Tokenizer
from worker.request import InvalidInput, SamplingParams


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: text, chat messages (rendered with the model's template), token ids."""

    text: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.messages, self.token_ids))
        if given != 1:
            raise InvalidInput("a request needs exactly one of a prompt, messages or token ids")

    @property
    def needs_template(self) -> bool:
        """Rendering a chat template is slow the first time (it imports jinja)."""
        return self.messages is not None


@dataclass(frozen=True)
class EngineRequest:
    """What the engine is handed: tokens, sampling parameters, scheduling hints."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None


class RequestBuilder:
    """Turns checked input into an `EngineRequest`, applying the engine's limits once."""

    def __init__(self, tokenizer: Tokenizer, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; InvalidInput for text the tokenizer cannot take."""
        try:
            if prompt.token_ids is not None:
                return list(prompt.token_ids)
            if prompt.messages is not None:
                return self.tokenizer.encode_chat([dict(m) for m in prompt.messages])
            assert prompt.text is not None
            return self.tokenizer.encode(prompt.text)
        except InvalidInput:
            raise
        except ValueError as e:
            raise InvalidInput(str(e)) from None

    def build(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Mapping[str, Any],
        *,
        default_max_tokens: int | None,
        priority: int | None = None,
        deadline: float | None = None,
    ) -> EngineRequest:
        """Check and complete a request.

        `sampling` holds the `SamplingParams` fields the request gave (its `max_tokens`,
        if given, is refused when the context cannot hold it); `default_max_tokens` is
        the input format's default (None = the rest of the context), clamped to what
        the context leaves.
        """
        self.limits.check_prompt(prompt_token_ids)
        fields = dict(sampling)
        fields["max_tokens"] = self.limits.max_tokens(
            fields.pop("max_tokens", None), default_max_tokens, len(prompt_token_ids)
        )
        try:
            params = SamplingParams(**fields)
        except TypeError as e:  # an unknown field name: a bug in the caller's parser
            raise InvalidInput(f"unknown sampling field: {e}") from None
        self.limits.check_params(params)
        return EngineRequest(
            request_id,
            prompt_token_ids,
            params,
            priority=check_priority(priority) if priority is not None else 0,
            deadline=deadline,
        )
