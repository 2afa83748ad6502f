"""Decode graphs' fixed-shape steps (worker.engine.decode_graphs) without capture, on CPU
through the torch attention path (the one CUDA takes): the same tokens and logits as the
steps op by op, and cache writes only where the step's rows write and in the scratch
block. Capture itself needs a GPU (tests/model/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch.fx.experimental.proxy_tensor import make_fx

import worker.engine.decode_graphs as graphs_mod
from worker.cli import build_engine_config, engine_options
from worker.config import EngineConfig
from worker.engine.decode_graphs import GraphKey, batch_bucket, blocks_bucket
from worker.engine.engine import LLMEngine
from worker.engine.outputs import ScheduledRequest
from worker.model.loader import LoadedModel, load_model
from worker.request import SamplingParams

VOCAB = 49152
VARIANTS = ["smollm2", "llama3", "llama2", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request: pytest.FixtureRequest, tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir(request.param)))


def make(tiny: LoadedModel, graphs: str, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(
        dtype="float32",
        attention="torch",
        decode_graphs=graphs,
        block_size=4,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(model=str(tiny.path), **cfg), loaded=tiny)  # type: ignore[arg-type]


def workload(n: int, seed: int, longest: int = 40) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 3 to `longest` tokens and greedy outputs of 2-24 tokens: the batch
    shrinks through several buckets as requests finish."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, longest, (n,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]
    outs = torch.randint(2, 25, (n,), generator=g).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    return prompts, params


def tokens(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_buckets() -> None:
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [batch_bucket(n) for n in (16, 17, 24, 25, 64)] == [16, 24, 24, 32, 64]
    assert [blocks_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]


def test_fixed_shape_steps_give_the_eager_steps_tokens(tiny: LoadedModel) -> None:
    prompts, params = workload(11, seed=3)
    plain = make(tiny, "off")
    assert plain.runner.decode_graphs is None
    want = tokens(plain, prompts, params)
    fixed = make(tiny, "eager")
    got = tokens(fixed, prompts, params)
    assert got == want
    graphs = fixed.runner.decode_graphs
    assert graphs is not None
    stats = graphs.stats
    # several buckets, every decode step through them (none past their bounds here)
    assert stats.failed is None and stats.eager_steps == 0
    assert stats.captured == len(set(stats.keys)) >= 3
    assert stats.replays >= max(p.max_tokens for p in params) - 1
    assert any(k.batch >= 8 for k in stats.keys) and any(k.batch <= 2 for k in stats.keys)


def test_steps_past_the_buckets_run_eagerly(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # graphs for contexts of up to 16 tokens (4 blocks of 4): longer ones run op by op
    monkeypatch.setattr(graphs_mod, "MAX_GRAPH_TOKENS", 16)
    prompts, params = workload(6, seed=4, longest=10)  # contexts cross 16 tokens
    want = tokens(make(tiny, "off"), prompts, params)
    fixed = make(tiny, "eager", max_num_seqs=4)
    assert tokens(fixed, prompts, params) == want
    graphs = fixed.runner.decode_graphs
    assert graphs is not None and graphs.max_blocks == 4 and graphs.max_batch == 4
    assert graphs.stats.replays > 0 and graphs.stats.eager_steps > 0
    assert all(k.blocks <= 4 and k.batch <= 4 for k in graphs.stats.keys)


def freeze(engine: LLMEngine) -> dict[GraphKey, object]:
    """Each bucket's step traced once (make_fx records its ops over the static buffers,
    every Python decision and host value fixed as it was) and the trace run in its place
    on later steps: on CPU, what a CUDA graph's replay does. A step that depended on
    anything but the static buffers' contents goes wrong here, not only on a GPU."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    traced: dict[GraphKey, object] = {}
    forward = graphs._forward

    def frozen(key: GraphKey) -> torch.Tensor:
        if key not in traced:
            traced[key] = make_fx(lambda: forward(key))()
        out: torch.Tensor = traced[key]()  # type: ignore[operator]
        return out

    graphs._forward = frozen  # type: ignore[method-assign]
    return traced


def test_frozen_steps_give_the_eager_steps_tokens(tiny: LoadedModel) -> None:
    prompts, params = workload(9, seed=6)
    want = tokens(make(tiny, "off"), prompts, params)
    fixed = make(tiny, "eager")
    traced = freeze(fixed)
    assert tokens(fixed, prompts, params) == want
    graphs = fixed.runner.decode_graphs
    assert graphs is not None and len(traced) == graphs.stats.captured >= 3
    assert graphs.stats.replays > len(traced)


def test_freezing_catches_a_step_that_reads_the_host(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: a mask built on the host from the lengths (as a capture
    would freeze it) gives the eager steps' tokens unfrozen and other tokens frozen."""

    def host_mask(lens: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
        visible = torch.zeros(len(lens), num_keys, dtype=torch.bool)
        for i, n in enumerate(lens.tolist()):
            visible[i, max(0, n - window) if window else 0 : n] = True
        return visible[:, None, None, :].to(lens.device)

    monkeypatch.setattr(graphs_mod, "decode_mask", host_mask)
    tiny = load_model(str(tiny_model_dir("smollm2")))
    prompts, params = workload(9, seed=6)
    want = tokens(make(tiny, "off"), prompts, params)
    assert tokens(make(tiny, "eager"), prompts, params) == want
    fixed = make(tiny, "eager")
    freeze(fixed)
    assert tokens(fixed, prompts, params) != want


def _slot(s: ScheduledRequest, bs: int) -> tuple[int, int]:
    return s.block_ids[s.start // bs], s.start % bs


def test_a_fixed_shape_step_matches_the_eager_one(tiny: LoadedModel) -> None:
    """Each step's logits against the eager step's over the same rows (which then writes
    the same K/V again), and the cache slots the fixed-shape step changed: its rows' own
    and the scratch block's, never another sequence's."""
    engine = make(tiny, "eager")
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    scratch, bs = graphs.scratch_block, runner.block_size
    assert scratch == engine.info.num_blocks
    assert all(k.shape[0] == v.shape[0] == scratch + 1 for k, v in runner.kv_caches)
    checked: list[tuple[int, GraphKey]] = []
    run = graphs.run

    def checking(members: list[ScheduledRequest], key: GraphKey) -> torch.Tensor | None:
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        out = run(members, key)
        assert out is not None
        for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
            for old, new in ((k0, k1), (v0, v1)):
                # [blocks, KVH, BS, D] -> the (block, offset) slots that changed
                where = (old != new).any(dim=-1).any(dim=1).nonzero().tolist()
                allowed = {_slot(s, bs) for s in members} | {(scratch, 0)}
                assert {tuple(w) for w in where} <= allowed
        eager, rows = runner._eager_step(members)
        assert eager is not None
        at = {s.request_id: i for i, s in enumerate(rows)}
        order = torch.tensor([at[s.request_id] for s in members])
        torch.testing.assert_close(out, eager[order], rtol=1e-4, atol=1e-4)
        checked.append((len(members), key))
        return out

    graphs.run = checking  # type: ignore[method-assign]
    prompts, params = workload(7, seed=5)
    engine.generate(prompts, params)
    assert checked
    # padded steps among them: their padding rows wrote token 0's K/V into the scratch block
    assert any(key.batch > n for n, key in checked)
    assert all(k[scratch].abs().sum() > 0 for k, _ in runner.kv_caches)


def test_a_row_that_does_not_sample_or_a_prompt_chunk_takes_no_graph(tiny: LoadedModel) -> None:
    engine = make(tiny, "eager")
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def row(start: int, n: int, known: int) -> ScheduledRequest:
        return ScheduledRequest(
            "r", list(range(3, 3 + known)), start, n, [0, 1, 2, 3], known, params, (2,)
        )

    assert graphs.key([row(5, 1, 6)]) == GraphKey(1, 2)  # the last token: samples
    assert graphs.key([row(5, 1, 6), row(6, 1, 7)]) == GraphKey(2, 2)
    assert graphs.key([row(4, 1, 6)]) is None  # a prompt's middle token: no sample
    assert graphs.key([row(0, 6, 6)]) is None  # prompt tokens
    assert graphs.key([]) is None
    assert graphs.stats.eager_steps == 0


def test_settings() -> None:
    with pytest.raises(ValueError, match="decode_graphs must be one of"):
        EngineConfig(decode_graphs="always")
    with pytest.raises(ValueError, match="attention 'torch'"):
        EngineConfig(decode_graphs="eager")
    assert EngineConfig.from_env({"KVFLOW_DECODE_GRAPHS": "off"}).decode_graphs == "off"
    assert EngineConfig().decode_graphs == "auto"

    seen: dict[str, EngineConfig] = {}

    import click

    @click.command()
    @engine_options
    def cmd(**kw: object) -> None:
        seen["config"] = build_engine_config(kw)

    result = CliRunner().invoke(cmd, ["--decode-graphs", "eager", "--attention", "torch"])
    assert result.exit_code == 0, result.output
    assert seen["config"].decode_graphs == "eager"
    bad = CliRunner().invoke(cmd, ["--decode-graphs", "sometimes"])
    assert bad.exit_code != 0 and "sometimes" in bad.output


def test_auto_on_cpu_says_why_not(tiny: LoadedModel) -> None:
    engine = make(tiny, "auto")
    assert engine.runner.decode_graphs is None
    assert engine.info.decode_graphs == "off (CUDA graphs are for CUDA, not cpu)"
    fixed = make(tiny, "eager")
    assert fixed.info.decode_graphs.endswith("as fixed-shape steps without capture (eager)")
    assert all(k.shape[0] == engine.info.num_blocks for k, _ in engine.runner.kv_caches)
