"""broker.turns.end_of_burst: a writer task waits while the loop is busy, a few turns at most."""

from __future__ import annotations

import asyncio

from broker.turns import MAX_TURNS, end_of_burst


async def _measure(busy_turns: int) -> tuple[int, int]:
    """Keep the loop busy for `busy_turns` turns (a callback that re-schedules itself);
    returns (turns the busy callback ran before end_of_burst returned, turns in all)."""
    ran = 0

    def busy() -> None:
        nonlocal ran
        ran += 1
        if ran < busy_turns:
            asyncio.get_running_loop().call_soon(busy)

    if busy_turns:
        asyncio.get_running_loop().call_soon(busy)
    await end_of_burst()
    return ran, busy_turns


async def test_an_idle_loop_returns_after_one_turn() -> None:
    ran, _ = await _measure(0)
    assert ran == 0


async def test_a_short_burst_is_waited_for() -> None:
    # Two busy turns: end_of_burst returns once the burst's callbacks have all run.
    ran, busy = await _measure(2)
    assert ran == busy


async def test_a_long_burst_is_waited_for_at_most_max_turns() -> None:
    ran, busy = await _measure(10 * MAX_TURNS)
    assert 1 <= ran <= MAX_TURNS < busy
