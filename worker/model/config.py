"""The model's shape, read from a Hugging Face `config.json`.

One dataclass covers the Llama family as served here: Llama 2/3 (incl. Llama 3.1 rope
scaling), Mistral, SmolLM2, Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF architecture name -> model family variant.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of one model of the Llama family."""

    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()  # extra rope parameters, sorted

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported; supported: {_ROPE_TYPES}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None and not archs:
            arch = cfg.get("model_type") if cfg.get("model_type") in _MODEL_TYPES else None
        if arch is None:
            found = archs or [cfg.get("model_type")]
            raise ValueError(
                f"unsupported model architecture {found}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_type, theta, extra = _rope_parameters(cfg)
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window size they don't use by default
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            rope_type=rope_type,
            rope_scaling=tuple(sorted(extra.items())),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path} is not a model directory: no config.json")
        return cls.from_hf(json.loads(cfg_path.read_text()))

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, float32 [head_dim // 2], with the configured scaling."""
        d = self.head_dim
        # float32 throughout, as the reference computes it: tables then agree to the last bit.
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        p = dict(self.rope_scaling)
        if self.rope_type == "linear":
            inv = inv / p["factor"]
        elif self.rope_type == "llama3":
            # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth
            # ramp in between (same formula as the reference implementation).
            factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old_ctx = p["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
            inv = torch.where(medium, smoothed, scaled)
        return inv


def _rope_parameters(cfg: dict[str, Any]) -> tuple[str, float, dict[str, float]]:
    """(rope type, theta, extra parameters) from either config style.

    transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 writes
    `rope_parameters` holding both.
    """
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")) or "default")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; supported: {_ROPE_TYPES}"
        )
    keep = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
        "default": (),
    }[rope_type]
    missing = [k for k in keep if k not in params]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} needs {missing} in the model config")
    return rope_type, theta, {k: float(params[k]) for k in keep}
