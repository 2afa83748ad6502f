"""The OpenAI request and response shapes used by `kvflow run-batch`.

Request bodies take the OpenAI fields plus vLLM's extra sampling fields; responses are
`chat.completion` / `text_completion` objects with usage. Anything malformed raises
ValueError with a message that names the field.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.builder import Prompt
from worker.engine.outputs import RequestOutput
from worker.limits import CHAT_DEFAULT_MAX_TOKENS, COMPLETIONS_DEFAULT_MAX_TOKENS
from worker.model.sampler import TokenLogprobs
from worker.model.tokenizer import Tokenizer

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# Body fields mapped one to one onto SamplingParams.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# Accepted and ignored (they do not change what is generated here); `model`, if given,
# must name the served model.
_IGNORED_FIELDS = ("model", "user", "metadata", "service_tier", "store")
_CHAT_ONLY = ("messages", "top_logprobs", "max_completion_tokens")
_COMPLETION_ONLY = ("prompt", "echo")
_COMMON = (
    *_SAMPLING_FIELDS,
    *_IGNORED_FIELDS,
    "max_tokens",
    "stop",
    "n",
    "stream",
    "logprobs",
    "priority",
    "skip_special_tokens",
)


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked OpenAI body, ready for `worker.builder.RequestBuilder`."""

    kind: str  # "chat" | "completion"
    prompt: Prompt
    sampling: dict[str, Any]  # SamplingParams fields the body gave
    priority: int
    default_max_tokens: int | None  # OpenAI's, by kind (None: the rest of the context)


def parse_body(url: str, body: Any, served_model: str) -> OpenAIRequest:
    """Check an OpenAI request body's shape; ValueError names what is wrong."""
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url must be {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}")
    if not isinstance(body, Mapping):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    chat = url == CHAT_URL
    allowed = set(_COMMON) | set(_CHAT_ONLY if chat else _COMPLETION_ONLY)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"unknown field(s) in body: {', '.join(unknown)}")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ValueError(f"model {model!r} is not served here; this batch runs {served_model!r}")
    if body.get("n", 1) != 1:
        raise ValueError(f"n must be 1, got {body.get('n')!r}")
    if body.get("stream", False) not in (False, None):
        raise ValueError("stream is not supported in a batch job")
    if body.get("echo", False) not in (False, None):
        raise ValueError("echo is not supported")

    if chat:
        if "messages" not in body:
            raise ValueError("a chat request needs 'messages'")
        prompt = Prompt(messages=_messages(body["messages"]))
    else:
        prompt = _completion_prompt(body)

    fields: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise ValueError("stop must be a string or a list of strings")
        fields["stop"] = tuple(stop)
    if "stop_token_ids" in fields:
        if not isinstance(fields["stop_token_ids"], list):
            raise ValueError("stop_token_ids must be a list of integers")
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    fields["logprobs"] = _logprobs(body, chat)
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = body.get("max_tokens", max_tokens)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if "skip_special_tokens" in body:
        fields["skip_special_tokens"] = body["skip_special_tokens"]
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    return OpenAIRequest(
        "chat" if chat else "completion",
        prompt,
        fields,
        priority,
        CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
    )


def _messages(value: Any) -> list[dict[str, str]]:
    """The messages as a list of objects; the tokenizer checks their roles and contents."""
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise ValueError("messages must be a list of {role, content} objects")
    return [dict(m) for m in value]


def _completion_prompt(body: Mapping[str, Any]) -> Prompt:
    if "prompt" not in body:
        raise ValueError("a completion request needs 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return Prompt(text=prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return Prompt(token_ids=list(prompt))
    raise ValueError("prompt must be a non-empty string or a list of token ids")


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    lp = body.get("logprobs")
    if chat:
        if lp in (None, False):
            if body.get("top_logprobs") is not None:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        if lp is not True:
            raise ValueError(f"logprobs must be a boolean in a chat request, got {lp!r}")
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int):
            raise ValueError(f"top_logprobs must be an integer, got {top!r}")
        return int(top)
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int):
        raise ValueError(f"logprobs must be an integer in a completion request, got {lp!r}")
    return int(lp)


def response_body(
    kind: str, request_id: str, model: str, out: RequestOutput, tokenizer: Tokenizer
) -> dict[str, Any]:
    """The chat.completion / text_completion object for a finished request."""
    created = int(time.time())
    n_out = len(out.token_ids)
    usage: dict[str, Any] = {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": out.num_prompt_tokens + n_out,
    }
    if out.num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    finish = str(out.finish_reason) if out.finish_reason is not None else None
    lps = out.logprobs
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": _chat_logprobs(lps, tokenizer) if lps is not None else None,
            "finish_reason": finish,
            "stop_reason": out.stop_reason,
        }
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
    choice = {
        "index": 0,
        "text": out.text,
        "logprobs": _completion_logprobs(lps, tokenizer) if lps is not None else None,
        "finish_reason": finish,
        "stop_reason": out.stop_reason,
    }
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _token_str(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(lps: list[TokenLogprobs], tokenizer: Tokenizer) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = _token_str(tokenizer, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
            for t in lps
        ]
    }


def _completion_logprobs(lps: list[TokenLogprobs], tokenizer: Tokenizer) -> dict[str, Any]:
    tokens = [_token_str(tokenizer, t.token_id) for t in lps]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [{_token_str(tokenizer, i): v for i, v in t.top} for t in lps],
        "text_offset": offsets,
    }
