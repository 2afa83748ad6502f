"""The producer client: submit requests to kvflow workers and await their replies.

    async with await Client.connect() as client:
        handle = await client.submit("Hello", max_tokens=32, stream=True)
        async for delta in handle.stream():
            print(delta["text"], end="")
        print(handle.final["usage"])

`SyncClient` offers the same for synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)

from broker.messages import (
    CONTENT_TYPE,
    ENQUEUED_AT_HEADER,
    SAMPLING_FIELDS,
    decode_reply,
    encode_request,
)
from broker.topology import (
    Topology,
    amqp_url_from_env,
    declare_request_path,
    redact_text,
    redact_url,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()


class BrokerUnavailable(ConnectionError):
    """RabbitMQ could not be reached, or the connection was lost (URL redacted)."""


class SubmitFailed(RuntimeError):
    """The broker did not take the request (unroutable, or refused by the queue)."""


class RequestFailed(Exception):
    """The worker answered with an error reply instead of a result."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


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
            if item is _END:
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
        self._replies.put_nowait(_END)


class Client:
    """An async producer: one connection, one exclusive reply queue, many requests.

    Build it with `await Client.connect(...)`. Replies are matched to requests by id.
    """

    def __init__(
        self,
        url: str,
        connection: AbstractConnection,
        channel: AbstractChannel,
        exchange: AbstractExchange,
        reply_queue: AbstractQueue,
        topology: Topology,
    ) -> None:
        self._url = url
        self._connection = connection
        self._channel = channel
        self._exchange = exchange
        self._reply_queue = reply_queue
        self.topology = topology
        self._pending: dict[str, Handle] = {}
        self._closing = False
        connection.close_callbacks.add(self._on_connection_closed)

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        queue: str | None = None,
        *,
        topology: Topology | None = None,
        declare_topology: bool = True,
        timeout: float = 10.0,
    ) -> Client:
        """Connect to `url` ($KVFLOW_AMQP_URL) and send to `queue` ($KVFLOW_QUEUE).

        Declares the request exchange and queues first (idempotent; not the control
        exchange, which is the workers' business) unless declare_topology is False.
        Raises BrokerUnavailable with the password redacted when RabbitMQ is unreachable.
        """
        url = amqp_url_from_env(url)
        topo = topology or Topology()
        if queue:
            topo = dataclasses.replace(topo, queue=queue)
        try:
            connection = await aio_pika.connect(url, timeout=timeout)
        except (OSError, asyncio.TimeoutError, aiormq.exceptions.AMQPError) as e:
            reason = redact_text(str(e) or type(e).__name__, url)
            raise BrokerUnavailable(
                f"cannot reach RabbitMQ at {redact_url(url)}: {reason}"
            ) from None
        try:
            channel = await connection.channel()
            if declare_topology:
                exchange = (await declare_request_path(channel, topo))[0]
            else:
                exchange = await channel.get_exchange(topo.exchange, ensure=False)
            reply_queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
            client = cls(url, connection, channel, exchange, reply_queue, topo)
            await reply_queue.consume(client._on_reply, no_ack=True)
        except BaseException:
            await connection.close()
            raise
        return client

    @property
    def reply_queue(self) -> str:
        return self._reply_queue.name

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        id: str | None = None,
        stream: bool = False,
        priority: int | None = None,
        deadline: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait_reply: bool = True,
        **sampling: Any,
    ) -> Handle:
        """Publish one request; returns once the broker has confirmed it (persistent).

        `sampling` takes the contract's sampling fields (max_tokens, temperature, ...).
        With wait_reply=False no reply_to is set: the result goes to the ledger only.
        Raises InvalidRequest (a ValueError) for a request the worker would refuse,
        SubmitFailed when the broker does not take it.
        """
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"submit() got unknown keyword argument(s): {', '.join(unknown)}")
        request_id = id or uuid.uuid4().hex
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already pending on this client")
        body = encode_request(
            id=request_id,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            priority=priority,
            deadline=deadline,
            stream=stream,
            metadata=metadata,
        )
        now = time.time()
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=request_id,
            correlation_id=request_id,
            timestamp=now,
            # A string: pamqp would send a Python float as a 32-bit float.
            headers={ENQUEUED_AT_HEADER: f"{now:.6f}"},
            reply_to=self._reply_queue.name if wait_reply else None,
        )
        handle = Handle(request_id, waits=wait_reply)
        if wait_reply:
            self._pending[request_id] = handle  # before publishing: replies can be fast
        try:
            outcome = await self._exchange.publish(
                message, routing_key=self.topology.queue, mandatory=True
            )
        except aiormq.exceptions.DeliveryError as e:
            self._pending.pop(request_id, None)
            raise SubmitFailed(f"the broker refused request {request_id!r}: {e}") from None
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        if isinstance(outcome, aiormq.abc.DeliveredMessage):
            self._pending.pop(request_id, None)
            raise SubmitFailed(
                f"request {request_id!r} was not routed: no queue {self.topology.queue!r} "
                f"bound to exchange {self.topology.exchange!r}"
            )
        return handle

    async def close(self) -> None:
        """Close the connection; pending handles fail with BrokerUnavailable."""
        self._closing = True
        self._fail_pending(BrokerUnavailable("the client was closed before the reply came"))
        if not self._connection.is_closed:
            await self._connection.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        try:
            reply = decode_reply(message.body)
        except ValueError as e:
            log.warning(
                "dropping a malformed reply (correlation_id %r): %s", message.correlation_id, e
            )
            return
        key = reply.get("id") or message.correlation_id
        handle = self._pending.get(str(key)) if key is not None else None
        if handle is None and message.correlation_id:
            handle = self._pending.get(message.correlation_id)
        if handle is None:
            log.debug("reply for unknown request %r dropped", key)
            return
        handle._deliver(reply)
        if handle.done:
            self._pending.pop(handle.id, None)

    def _on_connection_closed(self, _sender: Any, exc: BaseException | None = None) -> None:
        if not self._closing:
            reason = redact_text(str(exc), self._url) if exc else "closed"
            self._fail_pending(
                BrokerUnavailable(f"connection to {redact_url(self._url)} lost: {reason}")
            )

    def _fail_pending(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for handle in pending.values():
            handle._fail(error)


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
                return _END

        try:
            while (item := self._client._run(step())) is not _END:
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
