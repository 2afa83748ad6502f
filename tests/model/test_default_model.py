"""The bundled default model: our greedy output equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.request import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip.",
    "Où se trouve la tour Eiffel ? Réponds en français.",
]
MAX_TOKENS = 32


@pytest.mark.slow
def test_greedy_matches_transformers(default_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineConfig(num_kv_blocks=256))
    tok = engine.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))

    ref = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for prompt_ids, out in zip(ids, ours, strict=True):
        with torch.no_grad():
            gen = ref.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=list(tok.eos_token_ids),
                pad_token_id=tok.eos_token_ids[0],
            )
        want = gen[0, len(prompt_ids) :].tolist()
        assert out.token_ids == want, (tok.decode(out.token_ids), tok.decode(want))
        assert out.text == tok.decode(want)
    # A sanity check that the model is the real one: it knows its geography.
    assert "Paris" in ours[0].text
