"""The ledger store for synchronous callers (`kvflow run-batch`): its loop runs in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from worker.ledger.store import LedgerStore, RequestRecord

T = TypeVar("T")


class ThreadedLedger:
    """Owns an event loop in a daemon thread with a LedgerStore on it.

    `record()` never blocks the caller (the engine's step loop); `close()` waits until
    every queued record is committed (or the timeout passes) and returns how many were not.
    """

    def __init__(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvflow-ledger", daemon=True
        )
        self._thread.start()
        self._pending: list[concurrent.futures.Future[None]] = []
        try:
            self._store = self._call(LedgerStore.open(url))
        except BaseException:
            self._stop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def record(self, rec: RequestRecord) -> None:
        async def put() -> None:
            await self._store.record(rec)

        self._pending.append(asyncio.run_coroutine_threadsafe(put(), self._loop))

    def close(self, timeout_s: float = 60.0) -> int:
        """Flush and stop; returns the number of records that were not committed."""
        done, not_done = concurrent.futures.wait(self._pending, timeout=timeout_s)
        failed = sum(1 for f in done if f.exception() is not None) + len(not_done)
        failed += self._call(self._store.close(timeout_s))
        self._stop()
        return failed

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
