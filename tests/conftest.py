"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled default model, converted to a Hugging Face directory.

    Uses the default cache ($KVFLOW_CACHE_DIR or ~/.cache/kvflow), so only the first
    run on a machine pays for the conversion (~20 s).
    """
    from worker.model.gguf import cached_conversion, default_model_path

    return cached_conversion(default_model_path())


# -- tiny random-weight models of every supported variant, saved as HF directories --


VOCAB = 49152  # the default model's tokenizer is reused, so the vocabulary matches it

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _configs() -> dict[str, Callable[[], object]]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        # Llama 3.1: GQA, llama3 rope scaling, untied
        "llama3": lambda: LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        # Llama 2: multi-head attention, untied
        "llama2": lambda: LlamaConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
        ),
        # SmolLM2: 3 query heads per KV head, tied embeddings
        "smollm2": lambda: LlamaConfig(
            **{**COMMON, "hidden_size": 96},
            num_attention_heads=6,
            num_key_value_heads=2,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
        # Mistral: sliding window shorter than the test sequences
        "mistral": lambda: MistralConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            tie_word_embeddings=False,
        ),
        # Qwen2: bias on q/k/v
        "qwen2": lambda: Qwen2Config(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        ),
        # Qwen3: q/k RMSNorm, head_dim not hidden/heads
        "qwen3": lambda: Qwen3Config(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
        ),
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    """Factory: variant name -> HF directory with random weights and the default tokenizer."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant in made:
            return made[variant]
        cfg = _configs()[variant]()
        # A fixed seed per variant (not hash(), which Python salts per process).
        torch.manual_seed(1000 + sorted(_configs()).index(variant))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Random init leaves biases and norms trivial; perturb them so they matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        out = tmp_path_factory.mktemp(variant)
        model.save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (default_model_dir / f).exists():
                shutil.copy(default_model_dir / f, out / f)
        made[variant] = out
        return out

    return make
