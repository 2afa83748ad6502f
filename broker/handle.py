"""One submitted request as its producer sees it: the replies that arrive for its id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from broker.errors import RequestFailed

END = object()  # put on a handle's reply queue after its last reply


class Handle:
    """One submitted request: its id, and its replies as they arrive.

    `result()` waits for the final reply; `stream()` yields the deltas, then ends and
    leaves the result in `final`. Both raise `RequestFailed` on an error reply.
    """

    def __init__(self, request_id: str, waits: bool) -> None:
        self.id = request_id
        self.final: dict[str, Any] | None = None
        self._waits = waits
        self._error: BaseException | None = None
        self._finished = asyncio.Event()
        self._replies: asyncio.Queue[Any] = asyncio.Queue()
        self._streaming = False

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    async def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The result reply; raises RequestFailed, TimeoutError or BrokerUnavailable."""
        self._check_waits()
        try:
            await asyncio.wait_for(self._finished.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no result for request {self.id!r} within {timeout} s") from None
        return self._outcome()

    async def stream(self, timeout: float | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Yield delta replies in order; afterwards the result is in `final`.

        Yields nothing but still ends properly when the request was not submitted with
        stream=True. `timeout` bounds the whole stream, in seconds.
        """
        self._check_waits()
        if self._streaming:
            raise RuntimeError(f"request {self.id!r} is already being streamed")
        self._streaming = True
        loop = asyncio.get_running_loop()
        until = None if timeout is None else loop.time() + timeout
        while True:
            left = None if until is None else max(0.0, until - loop.time())
            try:
                item = await asyncio.wait_for(self._replies.get(), left)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"request {self.id!r} did not finish within {timeout} s"
                ) from None
            if item is END:
                break
            yield item
        self._outcome()

    def _check_waits(self) -> None:
        if not self._waits:
            raise RuntimeError(
                f"request {self.id!r} was submitted with wait_reply=False: no reply will "
                "come (the result goes to the ledger only)"
            )

    def _outcome(self) -> dict[str, Any]:
        if self._error is not None:
            raise self._error
        assert self.final is not None
        return self.final

    def _deliver(self, reply: dict[str, Any]) -> None:
        if self.done:
            return
        kind = reply.get("type")
        if kind == "delta":
            self._replies.put_nowait(reply)
            return
        if kind == "result":
            self.final = reply
        else:
            error = reply.get("error") or {}
            self._error = RequestFailed(
                str(error.get("code", "internal")), str(error.get("message", "")), self.id
            )
        self._finish()

    def _fail(self, error: BaseException) -> None:
        if not self.done:
            self._error = error
            self._finish()

    def _finish(self) -> None:
        self._finished.set()
        self._replies.put_nowait(END)
