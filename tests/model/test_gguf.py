"""GGUF conversion: tiny random models written the way llama.cpp writes them, and the real default model."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import worker.model.gguf as gguf_mod
from worker.model.gguf import (
    SUPPORTED_ARCHITECTURES,
    cached_conversion,
    convert_gguf,
    default_model_path,
    reverse_llama_permute,
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]

# Tiny shapes; qwen3 gets a head_dim unlike hidden/heads (as real Qwen3 models have).
TINY = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
    ),
}
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
THETA = 10000.0
EPS = 1e-5


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> list[str]:
    return SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k weights."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def make_tiny_model(
    arch: str, *, tied: bool = True, rope_scaling: dict[str, Any] | None = None
) -> Any:
    import torch
    import transformers

    config_class = getattr(transformers, HF_CLASS[arch].replace("ForCausalLM", "Config"))
    rope = (
        {"rope_type": "default", "rope_theta": THETA}
        if rope_scaling is None
        else {**rope_scaling, "rope_theta": THETA}
    )
    config = config_class(
        vocab_size=len(tiny_vocab()),
        num_hidden_layers=2,
        rms_norm_eps=EPS,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        **TINY[arch],
    )
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASS[arch])(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms and biases too, so a swapped or dropped one changes the logits.
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def write_gguf(path: Path, model: Any, arch: str, *, rope_freqs: np.ndarray | None = None) -> None:
    """Write `model` as llama.cpp would (F32 tensors, llama q/k permuted, gpt2 vocabulary)."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    tokens = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name, tensor in state.items():
        weight = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            weight = llama_cpp_permute(weight, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = llama_cpp_permute(weight, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class Tiny:
    arch: str
    model: Any
    gguf_path: Path
    out_dir: Path


@pytest.fixture(scope="module", params=SUPPORTED_ARCHITECTURES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    # qwen2 with an untied lm_head, so both layouts are covered.
    model = make_tiny_model(arch, tied=arch != "qwen2")
    path = root / f"tiny-{arch}.gguf"
    write_gguf(path, model, arch)
    convert_gguf(path, root / "hf")
    return Tiny(arch, model, path, root / "hf")


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(path, make_tiny_model("llama"), "llama")
    return path


def transformers_gguf_model(model_class: Any, gguf_path: Path) -> Any:
    """The model as transformers' own GGUF loader reads it (config, dequantization, q/k
    un-permuting). `from_pretrained(gguf_file=...)` would do the same but needs accelerate."""
    import transformers
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    with no_init_weights():  # every weight is loaded below; random init costs seconds
        model = model_class(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    model.tie_weights()
    return model.float().eval()


def _logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for rows, n_head in [(64, 4), (32, 2), (576, 9), (192, 3)]:
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(reverse_llama_permute(permuted, n_head), w)
        bias = w[:, 0].copy()
        np.testing.assert_array_equal(
            reverse_llama_permute(llama_cpp_permute(bias, n_head), n_head), bias
        )


def test_tiny_weights_equal_the_original(tiny: Tiny) -> None:
    from safetensors.numpy import load_file

    converted = load_file(str(tiny.out_dir / "model.safetensors"))
    original = {k: v.numpy() for k, v in tiny.model.state_dict().items()}
    if tiny.model.config.tie_word_embeddings:
        original.pop("lm_head.weight")
    assert set(converted) == set(original)
    for name, weight in original.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], weight, err_msg=name)
    if tiny.arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in converted
    if tiny.arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in converted


def test_tiny_config_and_tokenizer_files(tiny: Tiny) -> None:
    import json

    config = json.loads((tiny.out_dir / "config.json").read_text())
    cfg = tiny.model.config
    assert config["model_type"] == tiny.arch
    assert config["architectures"] == [HF_CLASS[tiny.arch]]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(cfg, key), key
    assert config["tie_word_embeddings"] == cfg.tie_word_embeddings
    assert config["rope_theta"] == THETA
    assert config["rms_norm_eps"] == EPS
    assert config["torch_dtype"] == "float32"
    assert "rope_scaling" not in config
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    generation = json.loads((tiny.out_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tok_config = json.loads((tiny.out_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHATML
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["add_bos_token"] is False
    assert (tiny.out_dir / "tokenizer.json").is_file()


def test_tiny_logits_match_the_original_and_transformers_gguf_loader(tiny: Tiny) -> None:
    import torch
    import transformers

    model_class = getattr(transformers, HF_CLASS[tiny.arch])
    ours = model_class.from_pretrained(str(tiny.out_dir), dtype=torch.float32).eval()
    theirs = transformers_gguf_model(model_class, tiny.gguf_path)
    ids = [5, 100, 200, 7, 3, 250, 11, 64, 64, 9, 150, 1, 2, 42]
    expected = _logits(tiny.model, ids)
    torch.testing.assert_close(_logits(ours, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(theirs, ids), expected, rtol=1e-5, atol=1e-5)


def _llama3_rope_freqs(
    factor: float, low: float, high: float, original: int, head_dim: int
) -> np.ndarray:
    """The rope_freqs.weight tensor llama.cpp's converter writes for Llama 3.1 models."""
    freqs = 1.0 / (THETA ** (np.arange(0, head_dim, 2) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(
    "scaling", [(8.0, 1.0, 4.0, 64), (32.0, 1.0, 4.0, 128), (8.0, 1.0, 4.0, 8192)]
)
def test_llama3_rope_scaling_is_recovered(
    tmp_path: Path, scaling: tuple[float, float, float, int]
) -> None:
    import json

    import torch
    import transformers

    factor, low, high, original = scaling
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    model = make_tiny_model("llama", rope_scaling=rope)
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(path, model, "llama", rope_freqs=_llama3_rope_freqs(factor, low, high, original, 16))
    convert_gguf(path, tmp_path / "hf")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        **{k: v for k, v in rope.items() if k != "rope_type"},
    }
    ours = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    ids = [(7 * i) % 260 for i in range(200)]  # long enough for the scaled frequencies to matter
    torch.testing.assert_close(_logits(ours, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_rope_freqs_that_fit_no_known_scaling_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd-rope.gguf"
    freqs = np.linspace(1.0, 3.0, 8)[::-1].copy()  # decreasing: not Llama 3's shape
    write_gguf(path, make_tiny_model("llama"), "llama", rope_freqs=freqs)
    with pytest.raises(ValueError, match="rope"):
        convert_gguf(path, tmp_path / "hf")


def test_unknown_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2") as excinfo:
        convert_gguf(path, tmp_path / "out")
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(excinfo.value)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        cached_conversion(path, cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_cached_conversion_converts_once(
    tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = cached_conversion(tiny_llama_gguf, tmp_path)
    assert first.parent == tmp_path
    assert first.name.startswith("tiny-llama-")
    assert (first / ".complete").is_file()
    assert (first / "model.safetensors").is_file()

    def refuse(*_: object) -> None:
        raise AssertionError("converted a second time")

    monkeypatch.setattr(gguf_mod, "convert_gguf", refuse)
    start = time.perf_counter()
    assert cached_conversion(tiny_llama_gguf, tmp_path) == first
    assert time.perf_counter() - start < 0.5
    # The cache root also comes from $KVFLOW_CACHE_DIR.
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    assert cached_conversion(tiny_llama_gguf) == first

    # A changed file (new mtime) converts again, into a directory of its own.
    monkeypatch.setattr(gguf_mod, "convert_gguf", convert_gguf)
    stat = tiny_llama_gguf.stat()
    os.utime(tiny_llama_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = cached_conversion(tiny_llama_gguf, tmp_path)
    assert second != first
    assert (second / ".complete").is_file()


def test_failed_conversion_leaves_nothing_that_looks_complete(
    tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_crash(src: Path, dst: Path) -> None:
        (Path(dst) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_mod, "convert_gguf", half_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        cached_conversion(tiny_llama_gguf, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(gguf_mod, "convert_gguf", convert_gguf)
    out = cached_conversion(tiny_llama_gguf, tmp_path)
    assert (out / ".complete").is_file()
    assert (out / "config.json").read_text() != "{}"


def _convert_in_child(gguf_path: str, cache_dir: str, log: str, barrier: Any, results: Any) -> None:
    """One of two processes that start a conversion at the same moment."""
    import worker.model.gguf as module

    real = module.convert_gguf

    def logged(src: Path, dst: Path) -> None:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        real(src, dst)

    module.convert_gguf = logged  # type: ignore[assignment]
    barrier.wait(timeout=120)
    results.put(str(module.cached_conversion(Path(gguf_path), Path(cache_dir))))


def test_concurrent_starts_convert_once(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    log = tmp_path / "conversions.log"
    cache = tmp_path / "cache"
    procs = [
        ctx.Process(
            target=_convert_in_child,
            args=(str(tiny_llama_gguf), str(cache), str(log), barrier, results),
        )
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    paths = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert paths[0] == paths[1]
    assert len(log.read_text().split()) == 1  # exactly one process converted
    entries = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert entries == [Path(paths[0]).name]
    assert (Path(paths[0]) / ".complete").is_file()


def test_default_model_path_is_the_bundled_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model_dir: Path) -> None:
    """The real model: our directory (the session's one conversion) and transformers' own
    GGUF loading agree."""
    import json

    import torch
    import transformers

    out = default_model_dir
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (
        30,
        576,
        9,
    )
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (
        3,
        64,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-05)

    ours = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    theirs = transformers_gguf_model(transformers.LlamaForCausalLM, default_model_path())
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.7.input_layernorm.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(ours_state[name], theirs_state[name], rtol=0, atol=0, msg=name)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    prompt: list[int] = tokenizer.apply_chat_template(  # type: ignore[assignment]
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    torch.testing.assert_close(_logits(ours, prompt), _logits(theirs, prompt), rtol=1e-4, atol=1e-4)
    # Not just equal to transformers: sensible (a permutation bug gives fluent garbage).
    with torch.no_grad():
        generated = ours.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0, len(prompt) :])
