"""Waiting for the end of a burst of event-loop callbacks before sending what it added.

Under load a burst of work (deliveries, confirms, engine outputs) spreads over a few
event-loop turns: a confirm wakes its caller a turn later, which then acks or records.
A batched writer that sends at the end of the first turn sends part of the burst, then
the rest in another system call or statement. These helpers wait while other callbacks
are ready, up to MAX_TURNS turns: an idle loop sends at once, a busy one waits a
fraction of a millisecond at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

MAX_TURNS = 4  # turns a write may wait while other callbacks are ready


def loop_is_busy(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether callbacks are ready to run on `loop` (its ready queue, when it has one)."""
    return bool(getattr(loop, "_ready", None))


class EndOfTurn:
    """Calls `flush` once after the event-loop turn in which `arm()` was first called
    since the last flush: at the end of that turn on an idle loop, up to MAX_TURNS turns
    later while other callbacks are ready (they may add to what `flush` sends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush: Callable[[], None]) -> None:
        self._loop = loop
        self._flush = flush
        self._turns = 0
        self._armed = False

    def arm(self) -> None:
        if not self._armed:
            self._armed = True
            self._turns = 0
            self._loop.call_soon(self._end_of_turn)

    def _end_of_turn(self) -> None:
        self._turns += 1
        if self._turns < MAX_TURNS and loop_is_busy(self._loop):
            self._loop.call_soon(self._end_of_turn)  # more may come in a moment
            return
        self._armed = False
        self._flush()


async def end_of_burst() -> None:
    """Return at the end of this event-loop turn, or up to MAX_TURNS turns later while
    other callbacks are ready: the awaitable form of EndOfTurn, for a writer task that
    gathers what a burst adds before it sends (the ledger's batches)."""
    loop = asyncio.get_running_loop()
    for _ in range(MAX_TURNS):
        await asyncio.sleep(0)
        if not loop_is_busy(loop):
            return
