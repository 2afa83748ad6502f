"""The producer client for synchronous code: `Client` on an event loop in a thread.

with SyncClient() as client:
    print(client.submit("Hello", max_tokens=32).result()["text"])
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from broker.client import Client
from broker.errors import BrokerUnavailable
from broker.handle import END, Handle
from broker.topology import Topology

T = TypeVar("T")


class SyncHandle:
    """A `Handle` for synchronous code; see `SyncClient`."""

    def __init__(self, handle: Handle, client: SyncClient) -> None:
        self._handle = handle
        self._client = client

    @property
    def id(self) -> str:
        return self._handle.id

    @property
    def final(self) -> dict[str, Any] | None:
        return self._handle.final

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the result; raises RequestFailed, TimeoutError, BrokerUnavailable."""
        return self._client._run(self._handle.result(timeout))

    def stream(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield delta replies as they arrive; afterwards the result is in `final`."""
        agen = self._handle.stream(timeout)

        async def step() -> Any:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return END

        try:
            while (item := self._client._run(step())) is not END:
                yield item
        finally:
            if not self._client.closed:
                self._client._run(agen.aclose())


class SyncClient:
    """The same as `Client` for synchronous code: runs an event loop in a thread.

    Use as a context manager, or call close(). Arguments as for `Client.connect`.
    """

    def __init__(
        self,
        url: str | None = None,
        queue: str | None = None,
        *,
        topology: Topology | None = None,
        declare_topology: bool = True,
        timeout: float = 10.0,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvflow-client", daemon=True
        )
        self._thread.start()
        self.closed = False
        try:
            self._client = self._run(
                Client.connect(
                    url,
                    queue,
                    topology=topology,
                    declare_topology=declare_topology,
                    timeout=timeout,
                )
            )
        except BaseException:
            self._stop()
            raise

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        queue: str | None = None,
        *,
        topology: Topology | None = None,
        declare_topology: bool = True,
        timeout: float = 10.0,
    ) -> SyncClient:
        """The same as the constructor, spelled like `Client.connect`."""
        return cls(
            url, queue, topology=topology, declare_topology=declare_topology, timeout=timeout
        )

    @property
    def topology(self) -> Topology:
        return self._client.topology

    def submit(self, prompt: str | None = None, **kwargs: Any) -> SyncHandle:
        """Publish one request; the arguments are those of `Client.submit`."""
        return SyncHandle(self._run(self._client.submit(prompt, **kwargs)), self)

    def close(self) -> None:
        if not self.closed:
            try:
                self._run(self._client.close())
            finally:
                self._stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.closed:
            coro.close()
            raise BrokerUnavailable("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _stop(self) -> None:
        self.closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()
