"""Random-weight models for the benchmarks: HF directories a run can load like any other."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def random_llama(
    out: Path, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any
) -> Path:
    """`out` as an HF directory: a Llama of `config` (LlamaConfig's fields; the default
    model's vocabulary and tied embeddings unless given) with random weights from `seed`,
    in `dtype`, and the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from worker.model.gguf import cached_conversion, default_model_path

    src = cached_conversion(default_model_path())
    cfg = LlamaConfig(**{"vocab_size": 49152, "tie_word_embeddings": True, **config})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out
