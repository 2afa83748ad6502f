"""asyncio front of the engine: the step loop runs in its own thread.

The event loop never waits for a step. Commands (add, abort) go to the engine thread
through a queue and take effect at the next step boundary; each step's outputs come
back in one `call_soon_threadsafe` and are routed to per-request streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from worker.engine.engine import Capacity, LLMEngine
from worker.engine.outputs import RequestOutput, StepStats
from worker.request import FinishReason, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    deadline: float | None


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


class _Stop:
    pass


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


class AsyncEngine:
    """Runs an LLMEngine in a dedicated thread; safe to call from one event loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._pending_tokens = 0  # prompt tokens submitted but not yet seen by the engine
        self._pending_count = 0
        self._capacity = engine.capacity()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats_listeners: list[Callable[[StepStats], None]] = []
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop (running requests are aborted)."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def add_stats_listener(self, fn: Callable[[StepStats], None]) -> None:
        """fn(stats) is called on the event loop after every step."""
        self._stats_listeners.append(fn)

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> RequestStream:
        """Submit a request; it joins the batch at the next step boundary.

        Raises ValueError at once for a request the engine could never serve.
        """
        if self._thread is None:
            raise RuntimeError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.engine.validate(prompt_token_ids, params)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        with self._lock:
            self._pending_tokens += len(prompt_token_ids)
            self._pending_count += 1
        self._commands.put(
            _Add(request_id, list(prompt_token_ids), params, arrival_time, priority, deadline)
        )
        return stream

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary (its stream gets a final 'abort')."""
        self._commands.put(_Abort((request_id,)))

    def is_running(self, request_id: str) -> bool:
        return request_id in self._streams

    def request_ids(self) -> list[str]:
        """Ids of the requests submitted and not yet finished."""
        return list(self._streams)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def capacity(self) -> Capacity:
        """The engine's capacity as of its last step, minus work submitted since."""
        with self._lock:
            cap, tokens, count = self._capacity, self._pending_tokens, self._pending_count
        return Capacity(
            free_blocks=cap.free_blocks,
            total_blocks=cap.total_blocks,
            block_size=cap.block_size,
            running=cap.running,
            waiting=cap.waiting + count,
            free_seqs=max(0, cap.free_seqs - count),
            waiting_tokens=cap.waiting_tokens + tokens,
            kv_usage=cap.kv_usage,
        )

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block only when there is nothing to step.
                cmds = [self._commands.get()] if not engine.has_unfinished() else []
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                outputs: list[RequestOutput] = []
                if self._apply(cmds, outputs):
                    outputs += engine.abort(list(engine.scheduler.requests))
                    self._deliver(outputs, None)
                    return
                stats = None
                if engine.has_unfinished():
                    outputs += engine.step()
                    stats = engine.last_stats
                    if stats is not None and stats.batch_size == 0 and not outputs:
                        time.sleep(0.001)  # nothing could be placed: don't spin
                with self._lock:
                    self._capacity = engine.capacity()
                if outputs or stats is not None:
                    self._deliver(outputs, stats)
        except BaseException as e:  # the loop must never die silently
            log.exception("engine step loop failed")
            self.error = e
            failed = [
                RequestOutput(rid, "", [], True, FinishReason.ABORT, error=f"engine failure: {e!r}")
                for rid in list(self._streams)
            ]
            self._deliver(failed, None)

    def _apply(self, cmds: list[_Add | _Abort | _Stop], outputs: list[RequestOutput]) -> bool:
        """Apply queued commands; True when asked to stop."""
        stop = False
        added_tokens = added = 0
        for cmd in cmds:
            if isinstance(cmd, _Add):
                added_tokens += len(cmd.prompt_token_ids)
                added += 1
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        arrival_time=cmd.arrival_time,
                        priority=cmd.priority,
                        deadline=cmd.deadline,
                    )
                except ValueError as e:
                    outputs.append(
                        RequestOutput(
                            cmd.request_id, "", [], True, FinishReason.ABORT, error=str(e)
                        )
                    )
            elif isinstance(cmd, _Abort):
                outputs += self.engine.abort(cmd.request_ids)
            else:
                stop = True
        if added:
            with self._lock:
                self._pending_tokens -= added_tokens
                self._pending_count -= added
        return stop

    def _deliver(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closed between check and call
            self._loop.call_soon_threadsafe(self._route, outputs, stats)

    def _route(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)
        if stats is not None:
            for fn in self._stats_listeners:
                try:
                    fn(stats)
                except Exception:
                    log.exception("stats listener failed")
