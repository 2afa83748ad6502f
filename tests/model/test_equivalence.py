"""Our model's logits equal transformers' for every supported variant and batch shape."""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import ScheduledRequest
from worker.model.loader import load_model
from worker.request import SamplingParams

BS = 4  # small blocks: sequences span many of them
ATOL = 2e-4
VARIANTS = ["llama3", "llama2", "smollm2", "mistral", "qwen2", "qwen3"]


def _ref_logits(ref_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref_model(torch.tensor([tokens])).logits[0].float()  # [L, V]


def _sched(rid: str, tokens: list[int], start: int, n: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens,
        start=start,
        num_new_tokens=n,
        block_ids=blocks,
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(temperature=0.0),
        eos_token_ids=(),
    )


@pytest.mark.parametrize(
    ("attention", "linear", "prefill"),
    [
        ("native", "auto", "float32"),
        ("torch", "auto", "float32"),
        ("native", "torch", "float32"),
        ("native", "auto", "native"),
        ("native", "auto", "flash"),
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_reference(
    variant: str, attention: str, linear: str, prefill: str, tiny_model_dir
) -> None:
    """Both decode attention paths: the C kernel reading blocks in place, the torch gather;
    linear weights packed for oneDNN where torch has it, and torch's plain matmul; prompt
    rows through SDPA or through the C kernel with the decode rows (native: mixed steps,
    a chunk on a cached prefix, a chunk continuing a chunk) or the C prompt kernel (flash;
    it refuses a sliding window)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(variant)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",  # exact float32 (auto may compute it as int16 products)
        block_size=BS,
        num_kv_blocks=64,
        attention=attention,
        linear=linear,
        prefill_attention=prefill,
    )
    if prefill == "flash" and variant == "mistral":
        with pytest.raises(ValueError, match="sliding window"):
            ModelRunner(cfg, load_model(str(path)))
        return
    runner = ModelRunner(cfg, load_model(str(path)))
    assert runner.info.attention.startswith(attention)
    assert runner.prefill_in_place == (prefill == "native")
    assert (runner.prefill_kernels is not None) == (prefill == "flash")
    assert runner.info.linear.startswith("torch" if linear == "torch" else "oneDNN")
    # with the C attention kernel the layers' small ops run in C too (but for a q/k norm)
    takes_ops = attention == "native" and variant != "qwen3"
    assert (runner.layer_ops is not None) == (attention == "native")
    assert all(
        layer.takes_layer_ops == takes_ops or runner.layer_ops is None
        for layer in runner.model.layers
    )
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 49152, (30,), generator=g).tolist()
    b = torch.randint(0, 49152, (26,), generator=g).tolist()
    c = a[:16] + torch.randint(0, 49152, (14,), generator=g).tolist()  # shares 4 blocks with a
    blocks_a, blocks_b = list(range(0, 8)), list(range(8, 15))
    blocks_c = blocks_a[:4] + list(range(20, 24))  # prefix-cache reuse of a's first blocks
    ra, rb, rc = _ref_logits(ref, a), _ref_logits(ref, b), _ref_logits(ref, c)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)

    # Step 1: a fresh prefill of a (23 tokens), alone.
    out = runner.all_logits([_sched("a", a, 0, 23, blocks_a)])
    check(out["a"], ra[0:23])
    # Step 2, mixed: a decodes position 23; b prefills its first chunk; c computes its
    # suffix on top of a's cached blocks (prefix reuse: context 16).
    out = runner.all_logits(
        [
            _sched("a", a, 23, 1, blocks_a),
            _sched("b", b, 0, 10, blocks_b),
            _sched("c", c, 16, 12, blocks_c),
        ]
    )
    check(out["a"], ra[23:24])
    check(out["b"], rb[0:10])
    check(out["c"], rc[16:28])
    # Step 3: chunked prefill continues b (context 10); a and c decode.
    out = runner.all_logits(
        [
            _sched("b", b, 10, 16, blocks_b),
            _sched("a", a, 24, 1, blocks_a),
            _sched("c", c, 28, 1, blocks_c),
        ]
    )
    check(out["b"], rb[10:26])
    check(out["a"], ra[24:25])
    check(out["c"], rc[28:29])
    # Decodes only, at different context lengths, then a alone to the end.
    out = runner.all_logits([_sched("a", a, 25, 1, blocks_a), _sched("c", c, 29, 1, blocks_c)])
    check(out["a"], ra[25:26])
    check(out["c"], rc[29:30])
    for pos in range(26, 30):
        check(runner.all_logits([_sched("a", a, pos, 1, blocks_a)])["a"], ra[pos : pos + 1])


def _bf16_pair(tiny_model_dir, prefill_attention: str, num_kv_blocks: int):
    """transformers' bf16 smollm2-shaped tiny model and a bf16 runner over the same weights."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cfg = EngineConfig(
        model=str(path),
        block_size=BS,
        num_kv_blocks=num_kv_blocks,
        dtype="bfloat16",
        prefill_attention=prefill_attention,
    )
    return ref, ModelRunner(cfg, load_model(str(path), dtype="bfloat16"))


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 keeps ~3 significant digits; both sides round differently in places."""
    return got.shape == want.shape and bool((got - want).abs().max() < 0.1 * want.abs().max())


@pytest.mark.parametrize("prefill_attention", ["float32", "bfloat16", "native", "flash"])
def test_bfloat16_close_to_reference(tiny_model_dir, prefill_attention: str) -> None:
    """bf16 linear layers, prefill attention on float32 or bfloat16 copies of q, k and v
    or through the C decode or prompt kernel from the bfloat16 cache (a prompt in two
    chunks: the second attends to the first through the cache; the prompt kernel writes
    the bfloat16 output projection's input through a float32 copy), stay close to
    transformers' bf16 model."""
    ref, runner = _bf16_pair(tiny_model_dir, prefill_attention, num_kv_blocks=32)
    assert runner.prefill_dtype == (torch.bfloat16 if prefill_attention == "bfloat16" else None)
    native = prefill_attention == "native"
    assert runner.prefill_in_place == native
    assert (runner.prefill_kernels is not None) == (prefill_attention == "flash")
    shown = {
        "native": "prefill attention native, in place",
        "flash": "prefill attention by the C prompt kernel, in place",
    }.get(prefill_attention, f"in {prefill_attention}")
    assert shown in runner.info.attention
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 49152, (20,), generator=g).tolist()
    other = torch.randint(0, 49152, (11,), generator=g).tolist()
    first = runner.all_logits(
        [_sched("x", toks, 0, 12, list(range(5))), _sched("y", other, 0, 10, [8, 9, 10])]
    )
    # A mixed step: y's decode row comes first, x's second chunk after it.
    second = runner.all_logits(
        [_sched("x", toks, 12, 8, list(range(5))), _sched("y", other, 10, 1, [8, 9, 10])]
    )
    for got, want in [
        (torch.cat([first["x"], second["x"]]), _ref_logits(ref, toks)),
        (torch.cat([first["y"], second["y"]]), _ref_logits(ref, other)),
    ]:
        assert _bf16_close(got, want)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


# Qwen3's head dim 32 holds two of an int8 cache's key groups (the others' 16, one).
@pytest.mark.parametrize(
    ("variant", "kv_cache_dtype"),
    [("smollm2", "float32"), ("smollm2", "bfloat16"), ("smollm2", "int8"), ("qwen3", "int8")],
)
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_bfloat16_decode_close_to_reference(
    attention: str, variant: str, kv_cache_dtype: str, tiny_model_dir
) -> None:
    """bf16 linear layers' decode rows, through either attention path and either cache
    dtype (a bf16 cache is widened to float32 where it is read, an int8 one dequantized),
    stay as close to transformers' bf16 model as its prefill does."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(variant)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cfg = EngineConfig(
        model=str(path),
        block_size=BS,
        num_kv_blocks=32,
        dtype="bfloat16",
        attention=attention,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(cfg, load_model(str(path), dtype="bfloat16"))
    assert runner.info.attention.startswith(attention)
    assert runner.kv_dtype == getattr(torch, kv_cache_dtype)
    dim = runner.model.config.head_dim  # int8 keys: a float32 scale per 16 values
    key_row = dim + dim // 4 if kv_cache_dtype == "int8" else dim
    # BS keys of key_row values a block and KV head: as rows, or bfloat16 keys in pairs
    # where auto takes them (a CPU with AMX)
    keys = runner.kv_caches[0][0]
    NB, KVH = keys.shape[:2]
    rows, pairs = (NB, KVH, BS, key_row), (NB, KVH, dim // 2, BS, 2)
    assert keys.shape == (pairs if runner.info.key_layout.startswith("pairs") else rows)
    toks = torch.randint(0, 49152, (28,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _ref_logits(ref, toks)
    blocks = list(range(7))
    runner.all_logits([_sched("x", toks, 0, 20, blocks)])
    got = torch.cat(
        [runner.all_logits([_sched("x", toks, p, 1, blocks)])["x"] for p in range(20, 28)]
    )
    assert (got - want[20:28]).abs().max() < 0.1 * want[20:28].abs().max()
    assert (got.argmax(-1) == want[20:28].argmax(-1)).float().mean() > 0.8


def test_a_half_precision_model_takes_float32_logits(tiny_model_dir) -> None:
    """A model in bfloat16 throughout (as on CUDA) computes its logits from a float32 copy
    of the output projection against the final norm's output widened, not rounded to
    bfloat16; on CPU the loader leaves it to the narrow projection (or float32 layers)."""
    loaded = load_model(str(tiny_model_dir("llama3")), dtype="bfloat16")
    model = loaded.model
    assert model.float_head is None  # CPU: a float32 residual stream, no copy
    model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, loaded.config.hidden_size, generator=g).to(torch.bfloat16)
    rounded = model.compute_logits(hidden)
    model.float_output_projection()
    assert model.float_head is not None and model.float_head.dtype == torch.float32
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    head = model.output_weight
    want = torch.nn.functional.linear(model.norm(hidden).float(), head.float())
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert not torch.equal(logits, rounded)  # the bfloat16 path rounds what this keeps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_in_half_precision_throughout_runs_the_engine(tiny_model_dir, dtype) -> None:
    """The CUDA path's dtypes, on CPU: every tensor of the model in half precision (the
    residual stream, norms, rotary tables, K/V), the torch ops for attention and linear
    layers, float32 logits. The engine generates 12 tokens a prompt through prefill and
    decode, and its first greedy tokens are float32's but for at most one prompt (half
    precision may flip a near-tie)."""
    from worker.engine.engine import LLMEngine

    path = str(tiny_model_dir("llama3"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 40, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cfg = EngineConfig(num_kv_blocks=64, attention="torch", linear="torch")
    full = LLMEngine(cfg, loaded=load_model(path, dtype="float32")).generate(prompts, params)
    loaded = load_model(path, dtype="bfloat16")
    loaded.model.to(dtype)
    loaded.model.float_output_projection()
    half_cfg = EngineConfig(
        num_kv_blocks=64, attention="torch", linear="torch", prefill_attention="float32"
    )
    engine = LLMEngine(half_cfg, loaded=loaded)
    assert loaded.model.embed_tokens.weight.dtype == dtype
    half = engine.generate(prompts, params)
    assert all(len(h.token_ids) == 12 for h in half)
    agree = sum(h.token_ids[0] == f.token_ids[0] for h, f in zip(half, full, strict=True))
    assert agree >= len(full) - 1


def test_auto_prompt_kernel_takes_long_chunks_and_leaves_short_ones_in_place(
    tiny_model_dir,
) -> None:
    """Where auto's prompt kernel takes only chunks of enough attention work
    (`prompt_kernel_min_work`), the shorter chunks' rows join the decode kernel's, laid
    out first whatever the scheduler's order; the step's logits stay transformers'."""
    from worker.engine.model_runner import prompt_kernel_work

    ref, runner = _bf16_pair(tiny_model_dir, "flash", num_kv_blocks=64)
    assert runner.prompt_kernel_min_work == 0  # asked for: every chunk through the kernel
    g = torch.Generator().manual_seed(5)
    long_toks = torch.randint(0, 49152, (40,), generator=g).tolist()
    short_toks = torch.randint(0, 49152, (6,), generator=g).tolist()
    decode_toks = torch.randint(0, 49152, (9,), generator=g).tolist()
    warm = runner.all_logits([_sched("d", decode_toks, 0, 8, [30, 31])])  # d's first 8
    runner.prefill_in_place = True
    runner.prompt_kernel_min_work = prompt_kernel_work(20, 0)  # between the two chunks
    assert prompt_kernel_work(6, 0) < runner.prompt_kernel_min_work <= prompt_kernel_work(40, 0)
    step = [
        _sched("long", long_toks, 0, 40, list(range(10))),
        _sched("d", decode_toks, 8, 1, [30, 31, 32]),
        _sched("short", short_toks, 0, 6, [20, 21]),
    ]
    inp = runner._prepare(step)
    assert [s.request_id for s in inp.order] == ["d", "short", "long"]
    assert [(p.start, p.end) for p in inp.meta.prefills] == [(7, 47)]  # long alone
    assert inp.meta.in_place is not None
    out = runner.all_logits(step)
    for rid, toks, got in (
        ("long", long_toks, out["long"]),
        ("short", short_toks, out["short"]),
        ("d", decode_toks, torch.cat([warm["d"], out["d"]])),
    ):
        assert _bf16_close(got, _ref_logits(ref, toks)), rid
