"""The decoder's layers as one run of C calls (worker.model.layer_stack): it gives the
per-op path's logits bit for bit for every step it takes, takes only the steps whose every
row the C kernels attend in place, and steps aside where the layers' weights changed."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from tests.model.builds import load_build, onednn_packs_bfloat16
from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import ScheduledRequest
from worker.model.layer_stack import MAX_ROWS
from worker.model.llama import Linear
from worker.model.loader import load_model
from worker.model.packing import attach_rows_weights
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
    K/V written again to the same slots). Where the stack loops over its layers in C, the
    step through its Python loop too, which must give the same bits."""
    stack = runner.layer_stack
    assert stack is not None
    assert runner._prepare(steps).meta.layer_stack is stack
    lib = stack.lib
    stack.lib = counter = _Counting(lib)
    try:
        with_stack = runner.all_logits(steps)
    finally:
        stack.lib = lib
    c_stack = stack.c_stack
    # the C loop is one call a step where there is one; else none of it
    assert counter.calls.get("kvflow_layer_stack", 0) == (c_stack is not None)
    runner.layer_stack = None
    try:
        per_op = runner.all_logits(steps)
        runner.layer_stack, stack.c_stack = stack, None
        if c_stack is not None:
            python_loop = runner.all_logits(steps)
            for key, logits in with_stack.items():
                assert torch.equal(logits, python_loop[key]), f"C loop and Python loop: {key}"
    finally:
        runner.layer_stack, stack.c_stack = stack, c_stack
    return with_stack, per_op


class _Counting:
    """A library's functions, each call counted by name."""

    def __init__(self, lib: object) -> None:
        self.lib, self.calls = lib, {}

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.lib, name)

        def call(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return call


def _int16_built() -> bool:
    return load_build("native").int16_built


def _stacked(tiny_model_dir, **kw: str) -> ModelRunner:
    """A runner of the tiny SmolLM2-shaped model in bfloat16, with a stack: through the
    row kernel where it is built, else through oneDNN's matmuls."""
    return _runner(tiny_model_dir, "smollm2", "bfloat16", "auto", **kw)


def _kinds(runner: ModelRunner) -> set[str]:
    assert runner.layer_stack is not None
    return {call.kind for w in runner.layer_stack.layers for call in w.linears}


def _drop_rows_weights(runner: ModelRunner) -> None:
    """The row kernel's copies dropped and the stack built again: the linear layers then
    go through oneDNN's packed bfloat16 matmul (as for a model too large for the copy),
    wherever the row kernel is built."""
    attach_rows_weights(runner.model, None)
    no_stack = runner.build_layer_stack()
    assert no_stack is None, no_stack


@pytest.mark.parametrize(
    ("variant", "dtype", "linear", "kv_cache", "kinds"),
    [
        # the row kernel where it is built (avx512_bf16; on AMX tiles where the CPU has
        # them), else oneDNN's matmul
        ("smollm2", "bfloat16", "auto", "auto", None),
        ("smollm2", "bfloat16", "auto", "float32", None),
        ("smollm2", "bfloat16", "auto", "int8", None),
        ("smollm2", "bfloat16", "auto", "bfloat16-int8", None),
        ("smollm2", "bfloat16", "auto", "bfloat16-int8/pairs", None),  # keys in pairs
        ("smollm2", "bfloat16", "auto", "bfloat16/pairs", None),
        # the row kernel's copies dropped: oneDNN's packed bfloat16 matmul, padded rows
        ("smollm2", "bfloat16", "onednn", "auto", {"torch"}),
        # Qwen2's q, k and v projections have a bias the row kernel does not take
        ("qwen2", "bfloat16", "auto", "auto", None),
        ("smollm2", "float32", "onednn", "auto", {"torch"}),  # packed float32, padded rows
        ("smollm2", "float32", "torch", "auto", {"torch"}),  # F.linear, no padding
        ("smollm2", "float32", "int16", "auto", {"int16"}),  # AVX2 or AVX-512 VNNI
        ("smollm2", "float32", "int16", "float32", {"int16"}),
        ("qwen2", "float32", "int16", "auto", {"int16"}),  # the bias through the C kernel
        ("mistral", "float32", "int16", "auto", {"int16"}),  # a sliding window
    ],
)
def test_the_stack_gives_the_per_op_paths_logits_bit_for_bit(
    tiny_model_dir, variant: str, dtype: str, linear: str, kv_cache: str, kinds: set[str] | None
) -> None:
    kv_cache, _, keys = kv_cache.partition("/")
    kw = {"prefill_attention": "native", "kv_cache_dtype": kv_cache, "key_layout": keys or "auto"}
    if linear == "int16" and not _int16_built():  # no AVX2 here
        with pytest.raises(ValueError, match="int16"):
            _runner(tiny_model_dir, variant, dtype, linear, **kw)
        return
    if linear == "onednn" and dtype == "bfloat16" and not onednn_packs_bfloat16():
        # asked for explicitly where oneDNN packs no bfloat16 (an AVX2-only CPU): refused
        with pytest.raises(ValueError, match="linear 'onednn' is not available"):
            _runner(tiny_model_dir, variant, dtype, linear, **kw)
        return
    runner = _runner(tiny_model_dir, variant, dtype, linear, **kw)
    assert runner.layer_stack is not None
    assert "one run of C calls" in runner.info.attention
    # the start-up facts say whether the loop over the layers runs in C
    assert ("loop over the layers in C" in runner.info.attention) == (
        runner.layer_stack.c_stack is not None
    )
    if kinds == {"torch"} and dtype == "bfloat16":
        _drop_rows_weights(runner)
    # the layers looped over in C wherever no linear layer goes through torch
    assert runner.layer_stack is not None
    assert (runner.layer_stack.c_stack is None) == ("torch" in _kinds(runner))
    if kinds is not None:
        assert _kinds(runner) == kinds
    elif runner.step_ops is not None and runner.step_ops.matmul_rows_built:
        # the row kernel, and oneDNN where a layer has a bias
        assert _kinds(runner) == ({"rows", "torch"} if variant == "qwen2" else {"rows"})
    else:
        assert _kinds(runner) == {"torch"}
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


@pytest.mark.parametrize(("dtype", "linear"), [("bfloat16", "auto"), ("float32", "int16")])
def test_the_stack_steps_aside_where_a_layers_weights_changed(
    tiny_model_dir, dtype: str, linear: str
) -> None:
    if linear == "int16" and not _int16_built():  # no AVX2 here: refused at start-up
        with pytest.raises(ValueError, match="int16"):
            _runner(tiny_model_dir, "smollm2", dtype, linear)
        return
    runner = _runner(tiny_model_dir, "smollm2", dtype, linear)
    stack = runner.layer_stack
    assert stack is not None and stack.current()
    step = [_seq(0, list(range(100, 140)), 39, 1)]
    down = runner.model.layers[1].mlp.down_proj
    assert isinstance(down, Linear)
    # the C kernels' weights (the row kernel's copy, the int16 weight) replaced by the
    # same values in another object, then dropped: not what the stack reads
    for attr in ("rows_weight", "int16_weight"):
        held = getattr(down, attr)
        if held is None:
            continue
        setattr(down, attr, held.clone() if isinstance(held, torch.Tensor) else replace(held))
        assert not stack.current()
        assert runner._prepare(step).meta.layer_stack is None
        setattr(down, attr, None)
        assert runner._prepare(step).meta.layer_stack is None
        setattr(down, attr, held)
        assert runner._prepare(step).meta.layer_stack is stack
    # the weight repacked (a new Parameter, another layout), then put back
    weight = down.weight
    if down.packed:
        down.unpack()
    elif down.weight.dtype != torch.bfloat16 or onednn_packs_bfloat16():
        down.pack(64)
    else:  # oneDNN packs no bfloat16 here (AVX2 only): the same values, a new Parameter
        down.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    assert not stack.current()
    assert runner._prepare(step).meta.layer_stack is None
    down.weight = weight
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


def test_a_kernel_refusing_inside_the_c_loop_is_named_with_its_layer(tiny_model_dir) -> None:
    """The loop in C stops at the first kernel that refuses and says which, in which layer
    (here the decode entry swapped for one that refuses in the second layer)."""
    runner = _stacked(tiny_model_dir, prefill_attention="native")
    stack = runner.layer_stack
    assert stack is not None
    if stack.c_stack is None:  # linear layers through torch here: no loop in C
        assert "torch" in _kinds(runner)
        return
    entry = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 7,
                             ctypes.c_float, ctypes.c_int)  # fmt: skip
    real = entry(stack.c_stack.decode)
    calls: list[int] = []

    def refuse_second(*args: object) -> int:
        calls.append(1)
        return 7 if len(calls) == 2 else int(real(*args))

    hook = entry(refuse_second)
    saved = stack.c_stack.decode
    stack.c_stack.decode = ctypes.cast(hook, ctypes.c_void_p).value
    try:
        with pytest.raises(RuntimeError, match=r"layer 1: paged decode attention failed \(7\)"):
            runner.all_logits([_seq(0, list(range(100, 140)), 0, 40)])
    finally:
        stack.c_stack.decode = saved
    assert len(calls) == 2
