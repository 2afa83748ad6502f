"""Find a model (HF directory, GGUF file or the bundled default) and load it.

A GGUF file is converted once into a cached HF directory (worker.model.gguf), so every
start after the first reads safetensors, memory-mapped: well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker.hardware import int8_reduce_range, read_cpu_flags
from worker.model.config import ModelConfig
from worker.model.gguf import cached_conversion, default_model_path
from worker.model.llama import NARROW_HEAD_MIN_HIDDEN, Linear, LlamaForCausalLM, Rotary
from worker.model.quant import Int8Linear
from worker.model.tokenizer import Tokenizer

# "int8" (CPU only): the linear layers are Int8Linear (worker.model.quant), the rest float32.
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.qint8,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path  # the HF directory the weights came from
    name: str  # a short name for logs, metrics and the ledger
    # whether `--dtype auto` chose the dtype (an engine that loaded it so says): float32
    # chosen by auto may compute as int16 products (worker.hardware.choose_int16_linear),
    # float32 asked for stays exact
    auto_dtype: bool = False


def resolve_model_dir(model: str | None, cache_dir: str | None = None) -> Path:
    """The HF directory for `model`: a directory as is, a .gguf converted (cached).

    Nothing is ever fetched from a model hub: a name that is not a local path is an error.
    """
    cache = Path(cache_dir) if cache_dir else None
    if model is None:
        return cached_conversion(default_model_path(), cache)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return cached_conversion(p, cache)
    if p.is_dir():
        return p
    raise FileNotFoundError(
        f"model {model!r} is neither a model directory nor a .gguf file "
        "(models are read from local paths only)"
    )


def load_model(
    model: str | None,
    dtype: str = "float32",
    device: str = "cpu",
    max_positions: int | None = None,
    cache_dir: str | None = None,
    head_dtype: str | None = None,
) -> LoadedModel:
    """Load weights and tokenizer; q/k/v and gate/up weights are fused on the way in.

    `dtype` is the decoder layers' linear layers' dtype. On CPU everything else
    (embeddings, norms, the residual stream, rotary tables, hence the KV cache) stays
    float32: bfloat16 only where it buys most speed. The output projection runs in
    `dtype` with its best candidates scored again in float32
    (`LlamaForCausalLM.narrow_output_projection`): with a plain bfloat16 projection the
    default model's next token agreed with float32's at 98.4% of positions, with a
    float32 one 99.1% (tests/model/test_default_model.py); a model with a hidden size
    under NARROW_HEAD_MIN_HIDDEN keeps one float32 projection. On CUDA the whole model
    takes `dtype`, its logits computed from a float32 copy of the output projection
    (`LlamaForCausalLM.float_output_projection`). "int8" (CPU only) loads the linear
    layers in float32 and quantizes them (`Int8Linear`), the output projection's narrow
    copy included. `head_dtype` (CPU; a key of DTYPES) sets the narrow copy's dtype apart
    from the linear layers': "int8" beside float32 layers
    (`worker.hardware.choose_output_head`).
    """
    dev = torch.device(device)
    if dtype == "int8" and dev.type != "cpu":
        raise ValueError(f"dtype int8 runs on CPU only, not on {device}")
    path = resolve_model_dir(model, cache_dir)
    cfg = ModelConfig.from_dir(path)
    torch_dtype = DTYPES[dtype]
    act_dtype = torch.float32 if dev.type == "cpu" else torch_dtype
    linear_dtype = act_dtype if torch_dtype == torch.qint8 else torch_dtype  # as stored
    net = LlamaForCausalLM(cfg, max_positions=1)  # uninitialised; the checkpoint fills it
    state = _read_state_dict(path, cfg, linear_dtype, act_dtype, dev)
    net.load_state_dict(state, strict=True, assign=True)
    net.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings).to(dev, act_dtype)
    narrow = dev.type == "cpu" and cfg.hidden_size >= NARROW_HEAD_MIN_HIDDEN
    head = DTYPES[head_dtype] if head_dtype is not None else torch_dtype
    # The CPU's int8 input width, read only where an int8 layer is made.
    reduce_range = torch.qint8 in (torch_dtype, head) and int8_reduce_range(read_cpu_flags())
    if torch_dtype == torch.qint8:
        _quantize_decoder(net, reduce_range)
    if narrow:
        net.narrow_output_projection(head, reduce_range)
    elif dev.type != "cpu" and act_dtype in (torch.bfloat16, torch.float16):
        net.float_output_projection()  # the whole model in half precision: float32 logits
    net.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(path)
    name = path.name.split("-")[0] if model is None else Path(model).stem
    return LoadedModel(
        net, cfg, tokenizer, path, name if model is not None else _default_name(path)
    )


def dtype_name(loaded: LoadedModel) -> str:
    """The name (a key of DTYPES) of the dtype the linear layers were loaded in."""
    for m in loaded.model.layers.modules():
        if isinstance(m, Int8Linear):
            return "int8"
        if isinstance(m, Linear):
            return DTYPE_NAMES[m.weight.dtype]
    raise ValueError("the model has no linear layers")


def activation_dtype(loaded: LoadedModel) -> torch.dtype:
    """The dtype of the residual stream and the KV cache (float32 on CPU)."""
    return loaded.model.embed_tokens.weight.dtype


def _quantize_decoder(net: LlamaForCausalLM, reduce_range: bool) -> None:
    """Swap each decoder layer's Linear for an Int8Linear of the same weights."""
    for parent in list(net.layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias, reduce_range))


def _default_name(path: Path) -> str:
    # The cache directory is "<gguf stem>-<hash>"; the stem is the model's name.
    return path.name.rsplit("-", 1)[0]


def _read_state_dict(
    path: Path, cfg: ModelConfig, dtype: torch.dtype, act_dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Fused weights on `device`: decoder linear layers (*_proj) in dtype, the rest in act_dtype."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raw[key.removeprefix("model.")] = st.get_tensor(key)
    if cfg.tie_word_embeddings:
        raw.pop("lm_head.weight", None)

    state: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise ValueError(f"weights in {path} lack tensor {name!r}") from None

    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        att = pre + "self_attn."
        state[att + "qkv_proj.weight"] = torch.cat(
            [take(att + "q_proj.weight"), take(att + "k_proj.weight"), take(att + "v_proj.weight")]
        )
        if cfg.qkv_bias:
            state[att + "qkv_proj.bias"] = torch.cat(
                [take(att + "q_proj.bias"), take(att + "k_proj.bias"), take(att + "v_proj.bias")]
            )
        state[att + "o_proj.weight"] = take(att + "o_proj.weight")
        if cfg.o_bias:
            state[att + "o_proj.bias"] = take(att + "o_proj.bias")
        if cfg.qk_norm:
            state[att + "q_norm.weight"] = take(att + "q_norm.weight")
            state[att + "k_norm.weight"] = take(att + "k_norm.weight")
        mlp = pre + "mlp."
        state[mlp + "gate_up_proj.weight"] = torch.cat(
            [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        )
        if cfg.mlp_bias:
            state[mlp + "gate_up_proj.bias"] = torch.cat(
                [take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")]
            )
            state[mlp + "down_proj.bias"] = take(mlp + "down_proj.bias")
        state[mlp + "down_proj.weight"] = take(mlp + "down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[pre + norm + ".weight"] = take(pre + norm + ".weight")
    state["embed_tokens.weight"] = take("embed_tokens.weight")
    state["norm.weight"] = take("norm.weight")
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    leftovers = [k for k in raw if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"unexpected tensors in {path}: {leftovers[:5]}")
    return {
        k: v.to(device=device, dtype=dtype if _is_linear(k) else act_dtype).contiguous()
        for k, v in state.items()
    }


def _is_linear(name: str) -> bool:
    return name.startswith("layers.") and name.rsplit(".", 2)[-2].endswith("proj")
