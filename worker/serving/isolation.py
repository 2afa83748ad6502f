"""Crash suspects run alone: the engine holds either them (one at a time) or everyone else.

A request that was in the engine when the engine process died is put back on the queue
with a crash count (`broker.messages.CRASHES_HEADER`). It cannot be told apart from the
request that caused the crash, so it runs alone: if the engine dies again, the request
that was alone in it is the cause (it ends `failed`); the others finish, and were not
charged a delivery for crashes they did not cause.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Isolation:
    """Admission to the engine: shared for ordinary requests, exclusive for suspects."""

    def __init__(self) -> None:
        self._in_engine = 0
        self._alone = False
        self._suspects_waiting = 0
        self._changed = asyncio.Condition()

    @property
    def alone(self) -> bool:
        """A suspect is in the engine by itself."""
        return self._alone

    @contextlib.asynccontextmanager
    async def enter(self, suspect: bool) -> AsyncIterator[None]:
        """Hold a place in the engine for the body of the `async with`. A suspect waits
        until the engine is empty and keeps it to itself; ordinary requests wait while a
        suspect runs or waits (so a suspect is not starved)."""
        async with self._changed:
            if suspect:
                self._suspects_waiting += 1
                try:
                    await self._changed.wait_for(lambda: self._in_engine == 0)
                finally:
                    self._suspects_waiting -= 1
                self._alone = True
            else:
                await self._changed.wait_for(
                    lambda: not self._alone and self._suspects_waiting == 0
                )
            self._in_engine += 1
        try:
            yield
        finally:
            async with self._changed:
                self._in_engine -= 1
                if suspect:
                    self._alone = False
                self._changed.notify_all()
