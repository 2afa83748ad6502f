"""The asyncio front: streams, aborts, capacity, and a free event loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from worker.config import EngineConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.engine import LLMEngine
from worker.model.loader import load_model
from worker.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir("smollm2")))


def engine(tiny, **kw) -> AsyncEngine:
    cfg = EngineConfig(model=str(tiny.path), block_size=4, num_kv_blocks=128, max_num_seqs=8, **kw)
    return AsyncEngine(LLMEngine(cfg, loaded=tiny))


def prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def test_streams_concatenate_to_final(tiny) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    async with engine(tiny) as eng:
        streams = [eng.add_request(f"r{i}", prompt(i), sp) for i in range(5)]
        for s in streams:
            deltas, toks, final = [], [], None
            async for out in s:
                deltas.append(out.delta_text)
                toks += out.delta_token_ids
                final = out
            assert final is not None and final.finished
            assert "".join(deltas) == final.text
            assert toks == final.token_ids and len(toks) == 20
            assert final.timing is not None and final.timing.ttft_s is not None
        assert eng.num_requests == 0


async def test_late_request_joins_running_batch(tiny) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    async with engine(tiny) as eng:
        first = eng.add_request("long", prompt(1), long)
        it = first.__aiter__()
        for _ in range(5):  # the long request is well into its decode
            await it.__anext__()
        late = await eng.add_request("late", prompt(2), short).result()
        assert late.finish_reason == FinishReason.LENGTH
        # The late one finished while the first was still generating.
        rest = [o async for o in it]
        assert rest[-1].finished and len(rest) > 10


async def test_abort_and_capacity(tiny) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    async with engine(tiny) as eng:
        cap0 = eng.capacity()
        assert cap0.free_blocks == 128 and cap0.free_seqs == 8
        s = eng.add_request("a", prompt(3, 40), sp)
        cap1 = eng.capacity()  # counted at once, before the engine thread has seen it
        assert cap1.free_seqs == 7 and cap1.waiting_tokens >= 40
        assert not cap1.can_admit(128 * 4)
        it = s.__aiter__()
        await it.__anext__()
        eng.abort("a")
        outs = [o async for o in it]
        assert outs[-1].finish_reason == FinishReason.ABORT
        await asyncio.sleep(0.05)
        assert eng.capacity().free_blocks == 128


async def test_event_loop_stays_free(tiny) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    async with engine(tiny) as eng:
        t = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(eng.add_request(f"x{i}", prompt(i), sp).result() for i in range(6))
        )
        t.cancel()
    steps = len(eng.engine.recent_stats)
    assert all(len(r.token_ids) == 80 for r in results)
    # The loop kept ticking while the engine stepped in its thread.
    assert ticks > steps / 4


async def test_invalid_request_raises_at_once(tiny) -> None:
    async with engine(tiny) as eng:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.add_request("bad", [10**9], SamplingParams())
        with pytest.raises(ValueError, match="prompt is empty"):
            eng.add_request("empty", [], SamplingParams())
