"""asyncio front of the engine; the step loop runs in its own thread or process.

The event loop never waits for a step. Commands (add, abort) reach the step loop
through a queue (thread) or a pipe (process) and take effect at the next step boundary;
each step's outputs come back as one `StepReport` and are routed to per-request streams.

`AsyncEngine` runs the step loop in a thread of this process (simple, shares the model
object: tests, run-batch-like tools). `worker.engine.process_engine.ProcessEngine` runs it
in a child process, so the step loop and the event loop never contend for the GIL: what
the queue worker uses.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from worker.engine.engine import Capacity, LLMEngine
from worker.engine.model_runner import RuntimeInfo
from worker.engine.outputs import RequestOutput, StepStats
from worker.engine.step_driver import Abort, Add, Command, StepDriver, StepReport, Stop
from worker.limits import RequestLimits
from worker.model.tokenizer import Tokenizer
from worker.request import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class RequestStream:
    """Async iterator over one request's outputs: deltas, then a final output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def _put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = await self._queue.get()
            if out.finished:
                self.finished = True
            yield out

    async def result(self) -> RequestOutput:
        """Consume the stream and return the final output."""
        last: RequestOutput | None = None
        async for out in self:
            last = out
        assert last is not None
        return last


class EngineFront(abc.ABC):
    """The asyncio side shared by both step-loop hosts: streams, capacity, routing.

    Safe to call from one event loop. Subclasses start the step loop and implement
    `_send(command)`; they call `_on_report` (on the event loop) with each StepReport.
    """

    def __init__(
        self, info: RuntimeInfo, limits: RequestLimits, tokenizer: Tokenizer, capacity: Capacity
    ) -> None:
        self.info = info
        self.limits = limits
        self.tokenizer = tokenizer
        self._streams: dict[str, RequestStream] = {}
        self._capacity = capacity
        self._pending_tokens = 0  # prompt tokens submitted but not yet in a report
        self._pending = 0
        self._stats_listeners: list[Callable[[StepStats], None]] = []
        self._running = False
        self.error: str | None = None
        # Called with (error, ids of the open requests) when the step loop dies, before
        # their streams end: the owner decides what becomes of them (the queue worker
        # gives their messages back to the queue).
        self.on_failure: Callable[[str, list[str]], None] | None = None

    @abc.abstractmethod
    def _send(self, command: Command) -> None:
        """Hand a command to the step loop (it takes effect at the next step boundary)."""

    def add_stats_listener(self, fn: Callable[[StepStats], None]) -> None:
        """fn(stats) is called on the event loop after every step."""
        self._stats_listeners.append(fn)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
        client: str = "default",
    ) -> RequestStream:
        """Submit a request; it joins the batch at the next step boundary.

        Raises ValueError at once for a request the engine could never serve.
        """
        if not self._running:
            raise RuntimeError(
                f"the engine is not running{': ' + self.error if self.error else ''}"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.limits.validate(prompt_token_ids, params)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._pending_tokens += len(prompt_token_ids)
        self._pending += 1
        self._send(
            Add(
                request_id,
                list(prompt_token_ids),
                params,
                arrival_time,
                priority,
                deadline,
                client,
            )
        )
        return stream

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary (its stream gets a final 'abort')."""
        self._send(Abort((request_id,)))

    def is_running(self, request_id: str) -> bool:
        return request_id in self._streams

    def request_ids(self) -> list[str]:
        """Ids of the requests submitted and not yet finished."""
        return list(self._streams)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def capacity(self) -> Capacity:
        """The engine's capacity as of its last report, minus work submitted since."""
        cap = self._capacity
        return Capacity(
            free_blocks=cap.free_blocks,
            total_blocks=cap.total_blocks,
            block_size=cap.block_size,
            running=cap.running,
            waiting=cap.waiting + self._pending,
            free_seqs=max(0, cap.free_seqs - self._pending),
            waiting_tokens=cap.waiting_tokens + self._pending_tokens,
            kv_usage=cap.kv_usage,
        )

    def _on_report(self, r: StepReport) -> None:
        self._capacity = r.capacity
        self._pending_tokens = max(0, self._pending_tokens - r.added_tokens)
        self._pending = max(0, self._pending - r.added)
        for out in r.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)
        if r.stats is not None:
            for fn in self._stats_listeners:
                try:
                    fn(r.stats)
                except Exception:
                    log.exception("stats listener failed")
        if r.error is not None:
            self._fail_all(r.error)

    def _fail_all(self, error: str) -> None:
        """The step loop is gone: every open stream ends with the error."""
        self.error = error
        self._running = False
        if self.on_failure is not None:
            try:
                self.on_failure(error, list(self._streams))
            except Exception:
                log.exception("engine failure callback failed")
        for rid, stream in list(self._streams.items()):
            stream._put(RequestOutput(rid, "", [], True, FinishReason.ABORT, error=error))
        self._streams.clear()


class AsyncEngine(EngineFront):
    """Runs an LLMEngine in a dedicated thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.info, engine.limits, engine.tokenizer, engine.capacity())
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        driver = StepDriver(self.engine, self._next_commands, self._report)
        self._thread = threading.Thread(target=driver.run, name="kvflow-engine", daemon=True)
        self._running = True
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop (running requests are aborted)."""
        if self._thread is None:
            return
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._running = False

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _send(self, command: Command) -> None:
        self._commands.put(command)

    def _next_commands(self, block: bool) -> list[Command]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _report(self, r: StepReport) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closed between check and call
            loop.call_soon_threadsafe(self._on_report, r)
