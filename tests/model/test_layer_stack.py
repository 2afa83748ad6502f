"""The decoder's layers as one run of C calls (worker.model.layer_stack): it gives the
per-op path's logits bit for bit for every step it takes, takes only the steps whose every
row the C kernels attend in place, and steps aside where the layers' weights changed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import ScheduledRequest
from worker.model.layer_stack import MAX_ROWS
from worker.model.llama import Linear
from worker.model.loader import load_model
from worker.model.native import load_native
from worker.request import SamplingParams

BLOCKS = 16  # cache blocks a sequence (16 tokens each)


def _seq(i: int, tokens: list[int], start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=str(i),
        token_ids=tokens,
        start=start,
        num_new_tokens=n,
        block_ids=list(range(i * BLOCKS, (i + 1) * BLOCKS)),
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(temperature=0.0),
        eos_token_ids=(),
    )


def _runner(tiny_model_dir, variant: str, dtype: str, linear: str, **kw: str) -> ModelRunner:
    loaded = load_model(str(tiny_model_dir(variant)), dtype=dtype)
    cfg = EngineConfig(num_kv_blocks=8 * BLOCKS, attention="native", linear=linear, **kw)
    return ModelRunner(cfg, loaded)


def _both(runner: ModelRunner, steps: list[ScheduledRequest]) -> tuple[dict, dict]:
    """all_logits of one step through the stack, then through the per-op path (the same
    K/V written again to the same slots)."""
    stack = runner.layer_stack
    assert runner._prepare(steps).meta.layer_stack is stack
    with_stack = runner.all_logits(steps)
    runner.layer_stack = None
    try:
        per_op = runner.all_logits(steps)
    finally:
        runner.layer_stack = stack
    return with_stack, per_op


def _stack_expected(linear: str) -> bool:
    kernels = load_native().kernels
    assert kernels is not None, "the C kernels build on every machine the tests run on"
    return kernels.int16_built if linear == "int16" else kernels.matmul_rows_built


def _stacked(tiny_model_dir, **kw: str) -> ModelRunner:
    """A runner of the tiny SmolLM2-shaped model with a stack: through the row kernel
    where it is built, else through the int16 products (built wherever there is AVX2)."""
    if _stack_expected("auto"):
        return _runner(tiny_model_dir, "smollm2", "bfloat16", "auto", **kw)
    assert _stack_expected("int16"), "no kernel a stack runs on is built here"
    return _runner(tiny_model_dir, "smollm2", "float32", "int16", **kw)


@pytest.mark.parametrize(
    ("variant", "dtype", "linear", "kv_cache"),
    [
        ("smollm2", "bfloat16", "auto", "auto"),  # the row kernel (avx512_bf16, no AMX)
        ("smollm2", "bfloat16", "auto", "float32"),
        ("smollm2", "bfloat16", "auto", "int8"),
        ("smollm2", "float32", "int16", "auto"),  # int16 products (AVX2 or AVX-512 VNNI)
        ("smollm2", "float32", "int16", "float32"),
        ("qwen2", "float32", "int16", "auto"),  # with a bias on q, k and v
        ("mistral", "float32", "int16", "auto"),  # a sliding window shorter than the prompts
    ],
)
def test_the_stack_gives_the_per_op_paths_logits_bit_for_bit(
    tiny_model_dir, variant: str, dtype: str, linear: str, kv_cache: str
) -> None:
    kw = {"prefill_attention": "native", "kv_cache_dtype": kv_cache}
    if not _stack_expected(linear):  # the kernels are not built for this CPU
        if linear == "int16":
            with pytest.raises(ValueError, match="int16"):
                _runner(tiny_model_dir, variant, dtype, linear, **kw)
            return
        runner = _runner(tiny_model_dir, variant, dtype, linear, **kw)
        assert runner.layer_stack is None
        assert "one run of C calls" not in runner.info.attention
        return
    runner = _runner(tiny_model_dir, variant, dtype, linear, **kw)
    assert runner.layer_stack is not None
    assert "one run of C calls" in runner.info.attention
    g = torch.Generator().manual_seed(21)
    seqs = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (20, 33, 40, 70)]
    # three prompts prefilled in one step (90 rows, each attended in place), then a decode
    # step of the three, then a decode row beside a new prompt's first chunk
    steps = [[_seq(i, seqs[i], 0, len(seqs[i]) - 1) for i in range(3)]]
    steps += [[_seq(i, seqs[i], len(seqs[i]) - 1, 1) for i in range(3)]]
    steps += [[_seq(0, seqs[0], 19, 1), _seq(3, seqs[3], 0, 50)]]
    for step in steps:
        with_stack, per_op = _both(runner, step)
        assert with_stack.keys() == per_op.keys()
        for key, logits in with_stack.items():
            assert torch.equal(logits, per_op[key]), f"{variant} {linear}: {key} moved"


def test_a_layer_with_a_bias_keeps_the_row_kernel_and_the_stack_off(tiny_model_dir) -> None:
    """The row kernel takes bias-free layers only; Qwen2's q/k/v projections have one, so
    in bfloat16 its layers go layer by layer (oneDNN for those projections)."""
    runner = _runner(tiny_model_dir, "qwen2", "bfloat16", "auto", prefill_attention="native")
    assert runner.layer_stack is None
    assert runner.model.layers[0].self_attn.qkv_proj.rows_weight is None


def test_the_stack_takes_only_steps_attended_in_place_within_its_rows(tiny_model_dir) -> None:
    g = torch.Generator().manual_seed(22)
    prompt = torch.randint(100, 40000, (MAX_ROWS + 40,), generator=g).tolist()
    native = _stacked(tiny_model_dir, prefill_attention="native")
    assert native.layer_stack is not None
    # more rows than its buffers hold: layer by layer
    assert native._prepare([_seq(0, prompt, 0, MAX_ROWS + 1)]).meta.layer_stack is None
    assert native._prepare([_seq(0, prompt, 0, MAX_ROWS)]).meta.layer_stack is not None
    # a prompt chunk attended by SDPA: layer by layer (its decode-only steps still taken)
    sdpa = _stacked(tiny_model_dir, prefill_attention="float32")
    assert sdpa.layer_stack is not None
    assert sdpa._prepare([_seq(0, prompt, 0, 30)]).meta.layer_stack is None
    assert sdpa._prepare([_seq(0, prompt, 30, 1)]).meta.layer_stack is not None


def test_the_stack_steps_aside_where_a_layers_weights_changed(tiny_model_dir) -> None:
    runner = _stacked(tiny_model_dir)
    stack = runner.layer_stack
    assert stack is not None and stack.current()
    step = [_seq(0, list(range(100, 140)), 39, 1)]
    down = runner.model.layers[1].mlp.down_proj
    assert isinstance(down, Linear)
    attr = "int16_weight" if down.int16_weight is not None else "rows_weight"
    held = getattr(down, attr)
    assert held is not None
    # the same values in another object: not what the stack reads
    setattr(down, attr, held.clone() if isinstance(held, torch.Tensor) else replace(held))
    assert not stack.current()
    assert runner._prepare(step).meta.layer_stack is None
    setattr(down, attr, None)  # the kernel's copy dropped: not the stack's either
    assert runner._prepare(step).meta.layer_stack is None
    setattr(down, attr, held)
    assert runner._prepare(step).meta.layer_stack is stack
    bias = torch.nn.Parameter(torch.zeros(down.weight.shape[0]))
    down.bias = bias  # a bias where there was none
    assert not stack.current()
    down.bias = None
    assert stack.current()
    # handed another model's caches, the stack refuses rather than writing into its own
    x = torch.zeros(1, runner.model.config.hidden_size)
    cos = torch.zeros(1, runner.model.config.head_dim // 2)
    meta = runner._prepare(step).meta
    with pytest.raises(ValueError, match="does not take"):
        stack.forward(x, cos, cos, list(runner.kv_caches), meta)
