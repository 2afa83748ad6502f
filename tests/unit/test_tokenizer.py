"""Tokenizer of the default model: encode/decode, chat template, streaming detokenizer."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.model.tokenizer import Tokenizer

VOCAB = 49152
TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "naïve café, ça va? Größe, Ærø, señor",
    "😀 emoji 👨‍👩‍👧 family, 🇫🇷 flag, ❤️",
    "中文字符和日本語のテキスト, 한국어",
    "tabs\tand\nnewlines\r\n",
    "x = 1000000; y = 3.14159",
    "Ω≈ç√∫˜µ≤≥÷ ∀∂∈ℝ",
]
# SmolLM2's byte-level vocabulary lacks the byte tokens for 0x04, 0x06, 0x13, 0x14, 0x16,
# 0x1D and the UTF-8 lead bytes 0xF1/0xF2, so those control characters and code points
# U+40000..U+BFFFF are silently dropped by encoding (transformers does the same).
DROPPED = "\x04\x06\x13\x14\x16\x1d"
ENCODABLE = st.text(
    st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=DROPPED), max_size=60
)
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "中文?"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_tok(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def partial_ids(tok: Tokenizer) -> list[int]:
    """Tokens that are only part of a UTF-8 character (they decode alone to U+FFFD)."""
    ids = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(ids) > 50
    return ids


def _variant(src: Path, dst: Path, **config_changes: Any) -> Path:
    """A copy of the model's tokenizer files with tokenizer_config.json changed."""
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_special_tokens_and_sizes(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_and_transformers_parity(
    tok: Tokenizer, hf_tok: Any, text: str
) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert ids[:1] != [1]  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(text=ENCODABLE)
def test_any_text_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_characters_without_byte_tokens_are_dropped(tok: Tokenizer, hf_tok: Any) -> None:
    text = "a\x04b\U00040000c"
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == "ab\ufffd\ufffd\ufffdc"  # 3 of 4 bytes survive
    assert tok.decode(tok.encode("\U000c0000")) == "\U000c0000"  # 0xF3 is in the vocabulary


def test_lone_surrogates_are_refused(tok: Tokenizer) -> None:
    text = json.loads('"bad \\ud800 text"')  # valid JSON, not valid Unicode
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode(text)


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_add_bos_token_is_honoured_without_doubling(
    default_model_dir: Path, tmp_path: Path
) -> None:
    bos_tok = Tokenizer.from_dir(_variant(default_model_dir, tmp_path / "bos", add_bos_token=True))
    plain = bos_tok.encode("hi", add_special_tokens=False)
    assert bos_tok.encode("hi") == [1, *plain]
    assert bos_tok.encode("<|im_start|>hi") == [1, *plain]  # the text's own BOS, not a second one
    assert bos_tok.encode("") == [1]
    chat = bos_tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[:2] != [1, 1]
    assert chat == bos_tok.encode(bos_tok.apply_chat_template([{"role": "user", "content": "hi"}]))


def test_unstated_add_bos_follows_the_post_processor(
    default_model_dir: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    path = _variant(default_model_dir, tmp_path / "pp", add_bos_token=None)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(path / "tokenizer.json"))
    assert Tokenizer.from_dir(path).encode("hi")[0] == 1
    plain = _variant(default_model_dir, tmp_path / "plain", add_bos_token=None)
    assert Tokenizer.from_dir(plain).encode("hi")[0] != 1


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )
    expected_ids = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_chat_template_adds_the_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (None, "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        (["hello"], "message 0 must be a dict"),
        ([{"role": "user"}], "message 0 needs a string 'content'"),
        ([{"content": "hi"}], "message 0 needs a string 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "message 1 needs"),
    ],
)
def test_bad_messages_are_refused(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        tok.encode_chat(messages)


def test_template_errors_become_value_errors(default_model_dir: Path, tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    path = _variant(default_model_dir, tmp_path / "strict", chat_template=template)
    strict = Tokenizer.from_dir(path)
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_chat_template(default_model_dir: Path, tmp_path: Path) -> None:
    bare = Tokenizer.from_dir(_variant(default_model_dir, tmp_path / "bare", chat_template=None))
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(default_model_dir: Path, tmp_path: Path) -> None:
    path = _variant(default_model_dir, tmp_path / "jinja", chat_template="from config")
    (path / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_dir(path).chat_template == "from file"


@pytest.mark.parametrize(
    ("generation_eos", "expected"), [(2, (2,)), ([2, 0, 5], (2, 0, 5)), ([7], (2, 7))]
)
def test_eos_ids_join_tokenizer_and_generation_config(
    default_model_dir: Path, tmp_path: Path, generation_eos: Any, expected: tuple[int, ...]
) -> None:
    path = _variant(default_model_dir, tmp_path / "eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert Tokenizer.from_dir(path).eos_token_ids == expected


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    """Stream `ids`, checking after every step that what came out is exactly the full
    decode so far, less a held-back tail that can only be an incomplete character."""
    detok = tok.detokenizer(skip_special_tokens=skip)
    pieces = []
    for n, token_id in enumerate(ids, 1):
        pieces.append(detok.step(token_id))
        so_far = "".join(pieces)
        full = tok.decode(ids[:n], skip_special_tokens=skip)
        assert detok.text == so_far
        assert full.startswith(so_far)
        held = full[len(so_far) :]
        assert held == "" or held.endswith("\ufffd")
    pieces.append(detok.flush())
    assert detok.flush() == ""
    return "".join(pieces)


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_detokenizer_invariant_random_ids(
    tok: Tokenizer, partial_ids: list[int], skip: bool, data: st.DataObject
) -> None:
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(partial_ids),  # split UTF-8 characters
        st.integers(0, 16),  # special tokens
    )
    ids = data.draw(st.lists(token, max_size=40))
    assert _stream(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=ENCODABLE)
def test_detokenizer_invariant_real_text(tok: Tokenizer, text: str) -> None:
    assert _stream(tok, tok.encode(text), skip=True) == text


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_emits_half_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == text
    assert detok.flush() == ""
    assert not any("\ufffd" in piece for piece in pieces)
    if any(ord(c) > 0x7F for c in text):
        assert "" in pieces  # some token only began a character, so it was held back


def test_detokenizer_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    detok = tok.detokenizer()
    streamed = "".join(detok.step(i) for i in ids[:-1])  # stop inside the emoji
    assert streamed == "ok"  # the space shares a token with the emoji's first byte
    tail = detok.flush()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert streamed + tail == tok.decode(ids[:-1])


def test_detokenizer_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nSure<|im_end|>")
    assert _stream(tok, ids, skip=True) == "assistant\nSure"
    assert _stream(tok, ids, skip=False) == "<|im_start|>assistant\nSure<|im_end|>"


def test_detokenizer_cost_does_not_grow_with_length(tok: Tokenizer) -> None:
    ids = tok.encode("Streaming text, one token at a time: ünïcödé and 😀. " * 800)
    detok = tok.detokenizer()
    start = time.perf_counter()
    for token_id in ids:
        detok.step(token_id)
    elapsed = time.perf_counter() - start
    assert detok.text == tok.decode(ids)
    # ~2 µs a step here; re-decoding the whole output each step would take many seconds.
    assert elapsed < 2.0, f"{len(ids)} steps took {elapsed:.2f} s"
