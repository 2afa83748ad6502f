"""Tokenizer of a Hugging Face model directory: encode, decode, chat templates, streaming.

Built on the `tokenizers` library directly, because `import transformers` alone costs
seconds at startup; transformers is imported lazily, only to render chat templates with
its own renderer (so templates behave exactly as they do in transformers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

# The named special tokens transformers hands to chat templates (its special_tokens_map).
_TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and special token ids.

    Built with `Tokenizer.from_dir`; immutable once built.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        add_bos_token: bool,
        template_tokens: dict[str, str],
    ) -> None:
        self._backend = backend
        self._bos_to_add = bos_token_id if add_bos_token else None
        self._template_tokens = dict(template_tokens)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json and tokenizer_config.json (plus chat_template.jinja and
        generation_config.json when present) from a Hugging Face model directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        template_tokens = {
            name: token for name in _TEMPLATE_TOKENS if (token := _token_text(config.get(name)))
        }
        bos_text = template_tokens.get("bos_token")
        bos_id = backend.token_to_id(bos_text) if bos_text else None
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]

        eos_ids: list[int] = []
        eos_text = template_tokens.get("eos_token")
        if eos_text and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos_ids.append(eos_id)
        gen_eos = generation.get("eos_token_id")
        eos_ids.extend([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []))

        # transformers gives chat_template.jinja priority over the config's entry.
        jinja = path / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        if template is None:
            template = _default_template(config.get("chat_template"))

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Not stated: do what tokenizer.json's post-processor does (Llama 3 adds BOS there).
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
            chat_template=template,
            add_bos_token=bool(add_bos),
            template_tokens=template_tokens,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, prepends BOS when the model
        wants one and the text does not already start with it."""
        try:
            ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        except TypeError as exc:
            # JSON may carry lone surrogates ("\ud800"): a str, but not encodable Unicode.
            raise ValueError("text contains a lone surrogate, which is not valid Unicode") from exc
        bos = self._bos_to_add
        if add_special_tokens and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid UTF-8 byte sequences become U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        _check_messages(messages)
        from jinja2.exceptions import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        # As transformers does: the named special tokens are template variables too.
        variables: dict[str, Any] = dict(self._template_tokens)
        try:
            # Annotated `-> str`, but returns (rendered conversations, generation indices).
            result: Any = render_jinja_template(
                conversations=[messages],
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        return str(result[0][0])

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat. The template writes any BOS itself, so no
        special tokens are added again (as transformers does)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self._backend, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for generated tokens one at a time.

    Concatenating every `step()` result, then `flush()`, equals decoding all the ids at
    once. Each step decodes only a short window: the tokens of the last emitted piece
    (context, so decoders that treat the first token specially behave as in a full
    decode) plus the tokens not yet emitted. Text ending in U+FFFD is held back, since a
    multi-byte UTF-8 character may still be incomplete.
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._window: list[int] = []  # context ids, then pending ids
        self._context_ids = 0  # how many of the window's ids are context
        self._context_chars = 0  # length of the context's decoded text
        self.text = ""

    def step(self, token_id: int) -> str:
        """The new text this token completes; "" while a character is still incomplete."""
        self._window.append(token_id)
        text = self._backend.decode(self._window, skip_special_tokens=self._skip)
        if len(text) <= self._context_chars or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD); call at the end."""
        if len(self._window) == self._context_ids:
            return ""
        text = self._backend.decode(self._window, skip_special_tokens=self._skip)
        if len(text) <= self._context_chars:
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        piece = text[self._context_chars :]
        # The ids just emitted become the next step's context.
        del self._window[: self._context_ids]
        self._context_ids = len(self._window)
        self._context_chars = len(
            self._backend.decode(self._window, skip_special_tokens=self._skip)
        )
        self.text += piece
        return piece


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {message.get(key)!r}")


def _token_text(value: Any) -> str | None:
    # transformers writes special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _default_template(value: Any) -> str | None:
    # Older configs may hold several named templates: [{"name": ..., "template": ...}].
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
