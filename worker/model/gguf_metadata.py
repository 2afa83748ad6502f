"""What a GGUF's metadata says about the model: shape, rope scaling, special tokens, HF config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class GGUFHyperparameters:
    """What a GGUF says about the model's shape, in Hugging Face terms."""

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tied_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def read_hyperparameters(reader: Any) -> GGUFHyperparameters:
    """Model shape, rope and special token ids from a `gguf.GGUFReader`."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")

    def required(key: str) -> Any:
        value = metadata_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    head_dim = metadata_value(reader, f"{arch}.attention.key_length") or hidden // heads
    rope_theta = _float32(metadata_value(reader, f"{arch}.rope.freq_base") or 10000.0)
    eos = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    # Llama 3 ends turns with <|eot_id|> / <|eom_id|> besides <|end_of_text|>.
    eos_ids = [eos] + [
        metadata_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")
    ]
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    return GGUFHyperparameters(
        arch=arch,
        num_layers=int(required("block_count")),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(metadata_value(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        # The embedding's rows, not the token list: some GGUFs pad one or the other.
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        rope_theta=rope_theta,
        rms_norm_eps=_float32(required("attention.layer_norm_rms_epsilon")),
        context_length=int(metadata_value(reader, f"{arch}.context_length") or 2048),
        tied_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(reader, arch, tensors, rope_theta, int(head_dim)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def hf_config(hp: GGUFHyperparameters) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this model would have."""
    config: dict[str, Any] = {
        "model_type": hp.arch,
        "architectures": [_HF_CLASSES[hp.arch]],
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "vocab_size": hp.vocab_size,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "max_position_embeddings": hp.context_length,
        "tie_word_embeddings": hp.tied_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if hp.arch != "qwen2":  # Qwen2 always has q/k/v biases and no such flag
        config["attention_bias"] = hp.attention_bias
    if hp.rope_scaling is not None:
        config["rope_scaling"] = hp.rope_scaling
    if hp.bos_token_id is not None:
        config["bos_token_id"] = hp.bos_token_id
    if hp.eos_token_ids:
        config["eos_token_id"] = one_or_list(hp.eos_token_ids)
    return config


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    original = metadata_value(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize

        tensor = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).ravel()
        return _llama3_rope_scaling(freqs, rope_theta, head_dim)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None and original is not None:
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
    raise ValueError(f"unsupported GGUF rope scaling {kind!r} (supported: linear, yarn, llama3)")


def _llama3_rope_scaling(
    freqs: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover Llama 3.1's rope_scaling from the per-frequency factors llama.cpp stores.

    llama.cpp bakes factor, low/high_freq_factor and the original context into one
    factor per rotary frequency; we find the parameters that reproduce those factors.
    """
    if freqs.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has {freqs.size} entries, expected {head_dim // 2}")
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    candidates: list[tuple[float, float, float]] = []
    smooth = (freqs > 1.0 + 1e-6) & (freqs < factor - 1e-6)
    # In the smooth band 1/r = (1 - s)/factor + s with s = (L/wavelen - lo)/(hi - lo), a
    # line in 1/wavelen. Assuming lo = 1 (as Meta does), its slope and intercept give hi and L.
    s = (1.0 / freqs[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if smooth.sum() >= 2:
        slope, intercept = np.polyfit(1.0 / wavelen[smooth], s, 1)
        if intercept < 0:
            high = 1.0 - 1.0 / intercept
            candidates.append((1.0, round(high, 4), round(slope * (high - 1.0))))
    elif smooth.sum() == 1:  # one point: take Meta's hi = 4 and solve for L
        candidates.append((1.0, 4.0, round(float(wavelen[smooth][0] * (s[0] * 3.0 + 1.0)))))
    # Few rotary dimensions leave the parameters ambiguous; any set that reproduces the
    # factors gives the same model, so try the usual ones.
    candidates += [
        (1.0, high, 2.0**e)
        for e in (13, 12, 11, 14, 15, 16, 17, 10, 9, 8, 7, 6)
        for high in (4.0, 2.0, 8.0)
    ]
    for low, high, original in candidates:
        expected = _llama3_factors(wavelen, factor, low, high, original)
        if np.allclose(expected, freqs, rtol=1e-4, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original),
            }
    raise ValueError("GGUF rope_freqs.weight does not match Llama 3 style rope scaling")


def _llama3_factors(
    wavelen: np.ndarray, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    # The factors llama.cpp's converter writes for Llama 3 rope scaling.
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, mid)
    return np.where(wavelen > original / low, factor, out)


def metadata_value(reader: Any, key: str) -> Any:
    """A scalar metadata value (str, int, float, bool), or None when absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if field.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array, expected a single value")
    return part.tolist()[0]


def _float32(value: float) -> float:
    # GGUF stores float32: keep its shortest decimal form (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def one_or_list(ids: tuple[int, ...]) -> int | list[int]:
    """One id as an int, several as a list (the form HF configs use)."""
    return ids[0] if len(ids) == 1 else list(ids)
