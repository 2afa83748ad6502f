"""`kvflow worker`: RabbitMQ in, continuous batch, replies and the ledger out.

Flow control: the worker pulls (basic.get) one message at a time, and only while the
engine can place more work: a free sequence slot (running + waiting + being admitted
below max_num_seqs + lookahead) and KV room for the waiting prompts plus a reserve.
So it never sits on a backlog another worker could serve, and a pulled request joins
the running batch at the next step boundary.

Shutdown (SIGTERM/SIGINT) drains: no more pulls, running requests finish up to the
drain timeout, what is left is requeued (never dead-lettered), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import aio_pika
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from broker.messages import RequestMessage
from broker.publisher import ReplyPublisher
from broker.topology import Topology, declare, redact_url
from worker.config import EngineConfig, ServiceConfig
from worker.control import ControlListener
from worker.engine.async_engine import AsyncEngine, EngineFront
from worker.engine.engine import LLMEngine
from worker.engine.outputs import RequestOutput, StepStats
from worker.engine.process_engine import ProcessEngine
from worker.handler import HandlerEvents, RequestHandler
from worker.ledger.store import LedgerStore, WorkerRecord
from worker.metrics import Metrics

log = logging.getLogger(__name__)


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPED = "stopped"


async def _first(*waits: Awaitable[object]) -> None:
    """Wait until the first of several awaitables is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Service:
    """One worker process: owns the engine, the broker connection and the ledger store."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServiceConfig,
        *,
        llm: LLMEngine | None = None,
        events: HandlerEvents | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.config = config
        self.worker_id = config.worker_id or default_worker_id()
        self.topology = Topology(queue=config.queue, delivery_limit=config.delivery_limit)
        self.state = WorkerState.STARTING
        self.started_at = time.time()
        self._llm = llm
        self._events = events or HandlerEvents()
        self.metrics: Metrics | None = None
        self.control: ControlListener | None = None
        self._tasks: dict[asyncio.Task[None], AbstractIncomingMessage] = {}
        self._admitting = 0
        self._capacity_changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._resume = asyncio.Event()
        self._tok_window: deque[tuple[float, int]] = deque(maxlen=256)
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self.engine: AsyncEngine | ProcessEngine | None = None
        self.handler: RequestHandler | None = None
        self.ledger: LedgerStore | None = None
        self.connection: AbstractRobustConnection | None = None
        self.queue: AbstractQueue | None = None
        self.pulled = 0
        self.failure: str | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        cfg = self.config
        self.ledger = await LedgerStore.open(cfg.database_url)
        try:
            self.connection = await aio_pika.connect_robust(
                cfg.amqp_url,
                client_properties={"connection_name": f"kvflow-worker {self.worker_id}"},
            )
        except Exception as e:
            await self.ledger.close()
            raise ConnectionError(
                f"cannot reach RabbitMQ at {redact_url(cfg.amqp_url)}: {e}"
            ) from None
        try:
            consume = await self.connection.channel(publisher_confirms=False)
            publish = await self.connection.channel(publisher_confirms=True)
            declared = await declare(publish, self.topology)
            self.queue = await consume.get_queue(declared.queue.name, ensure=False)
            # The step loop runs in its own process (no GIL shared with this event
            # loop) unless an engine object was handed in (tests).
            front: EngineFront
            if self._llm is not None:
                front = self.engine = AsyncEngine(self._llm)
            else:
                front = self.engine = await ProcessEngine.launch(self.engine_config)
            self._start_metrics(front.info.model_name)
            self.engine.add_stats_listener(self._on_step)
            self.handler = RequestHandler(
                self.engine,
                front.tokenizer,
                self.ledger,
                ReplyPublisher(publish),
                cfg,
                self.worker_id,
                front.info.model_name,
                self._events,
            )
            self.engine.on_failure = self._engine_failed
            await self.engine.start()
            self.control = ControlListener(self, publish, self.handler.publisher)
            await self.control.start()
            self._install_signals()
            self._set_state(WorkerState.SERVING)
            self._resume.set()
            log.info(
                "worker %s serving %s (%s on %s): broker %s",
                self.worker_id,
                cfg.queue,
                front.info.model_name,
                front.info.device,
                redact_url(cfg.amqp_url),
            )
            beat = asyncio.create_task(self._heartbeats(), name="heartbeat")
            intake = asyncio.create_task(self._intake(), name="intake")
            intake.add_done_callback(self._intake_done)
            await self._stop.wait()
            # Not cancelled: a basic.get cancelled in flight makes the client close the
            # channel, and with it the acks of requests still finishing.
            try:
                await asyncio.wait_for(intake, 15)
            except TimeoutError:
                log.warning("the intake did not stop within 15 s")
            await self.drain(cfg.drain_timeout_s)
            self._set_state(WorkerState.STOPPED)
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await self._heartbeat_once()
            return 1 if self.failure is not None else 0
        finally:
            if self.engine is not None:
                await self.engine.stop()
            if self.ledger is not None:
                left = await self.ledger.close()
                if left:
                    log.error("%d ledger writes were not committed at exit", left)
            await self.connection.close()

    def _start_metrics(self, model: str) -> None:
        m = self.metrics = Metrics(self.worker_id, model)
        ledger = self.ledger
        assert ledger is not None
        m.watch_ledger(
            lambda: ledger.pending,
            lambda: (ledger.write_latency.count, ledger.write_latency.total_s),
            lambda: ledger.errors,
        )
        ev = self._events
        chained_received, chained_finished, chained_outcome = (
            ev.on_received,
            ev.on_finished,
            ev.on_outcome,
        )

        def received(message: AbstractIncomingMessage) -> None:
            m.on_message("received")
            if message.redelivered:
                m.on_message("redelivered")
            if chained_received:
                chained_received(message)

        def finished(out: RequestOutput, req: RequestMessage) -> None:
            m.on_finished(out)
            if chained_finished:
                chained_finished(out, req)

        def outcome(what: str) -> None:
            m.on_message(what)
            if chained_outcome:
                chained_outcome(what)

        self._events = HandlerEvents(received, finished, outcome)
        if self.config.metrics_port is not None:
            m.serve(self.config.metrics_host, self.config.metrics_port)
            log.info("metrics on %s:%d/metrics", self.config.metrics_host, self.config.metrics_port)

    def _set_state(self, state: WorkerState) -> None:
        self.state = state
        if self.metrics is not None:
            self.metrics.set_state(state.value, tuple(s.value for s in WorkerState))

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does)."""
        if not self._stop.is_set():
            log.info("worker %s: shutting down, draining", self.worker_id)
            self._stop.set()
            self._capacity_changed.set()

    def _engine_failed(self, error: str, request_ids: list[str]) -> None:
        """The engine died: its requests go back to the queue (another worker, or this
        one restarted, runs them), and the worker stops with a non-zero exit code."""
        log.error(
            "worker %s: engine failed (%s); requeueing %d requests and stopping",
            self.worker_id,
            error,
            len(request_ids),
        )
        self.failure = error
        if self.handler is not None:
            self.handler.accepting = False
            self.handler.requeue_ids.update(request_ids)
        self.request_stop()

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)

    # -- pulling work ----------------------------------------------------------------------

    def can_pull(self) -> bool:
        """True when one more request could be placed in the batch (or the look-ahead)."""
        assert self.engine is not None
        cap = self.engine.capacity()
        # A finished request's message stays unacked until its ledger row commits and
        # its reply is confirmed: count messages held, not only requests in the engine.
        held = max(cap.running + cap.waiting + self._admitting, len(self._tasks))
        if held >= self.engine_config.max_num_seqs + self.config.lookahead:
            return False
        return cap.free_tokens >= self.config.reserve_blocks * cap.block_size

    async def _intake(self) -> None:
        assert self.queue is not None
        pause = 0.002
        while not self._stop.is_set():
            if not self._resume.is_set():
                await _first(self._resume.wait(), self._stop.wait())
                continue
            if not self.can_pull():
                self._capacity_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity_changed.wait(), 0.5)
                continue
            try:
                message = await self.queue.get(no_ack=False, fail=False, timeout=10)
            except Exception as e:  # a closed channel, a timed-out get: the robust
                # connection reopens the channel; the intake must outlive it
                log.warning("pull failed (%r); retrying", e)
                await asyncio.sleep(0.5)
                continue
            if message is None:
                if self.config.burst and not self._tasks:
                    log.info("queue empty and nothing in flight: burst mode ends")
                    self.request_stop()
                    return
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.config.poll_max_s)
                continue
            pause = 0.002
            if not self._resume.is_set() or self._stop.is_set():
                # A drain began while this pull was in flight: give the message back.
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
                continue
            self.pulled += 1
            self._spawn(message)

    def _intake_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # Without its intake the worker would heartbeat 'serving' and never pull again.
        log.error("the intake stopped unexpectedly; shutting down", exc_info=task.exception())
        self.failure = self.failure or f"intake failed: {task.exception()!r}"
        self.request_stop()

    def _spawn(self, message: AbstractIncomingMessage) -> None:
        assert self.handler is not None
        # The request counts as "being admitted" until the engine has it (or it ended
        # without running): only then does the engine's capacity figure include it.
        self._admitting += 1
        pending = True

        def admitted() -> None:
            nonlocal pending
            if pending:
                pending = False
                self._admitting -= 1
                self._capacity_changed.set()

        async def run() -> None:
            try:
                assert self.handler is not None
                await self.handler.handle(message, admitted)
            finally:
                admitted()

        task = asyncio.create_task(run())
        self._tasks[task] = message
        task.add_done_callback(self._task_done)
        if self.metrics is not None:
            self.metrics.unacked.set(len(self._tasks))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if self.metrics is not None:
            self.metrics.unacked.set(len(self._tasks))
        if not task.cancelled() and task.exception() is not None:
            log.error("request task failed", exc_info=task.exception())

    def _on_step(self, stats: StepStats) -> None:
        self._tok_window.append(
            (time.time(), stats.num_decode_tokens + (1 if stats.num_prefill_tokens else 0))
        )
        self._capacity_changed.set()
        if self.metrics is not None:
            self.metrics.on_step(stats)
        for fn in self.stats_listeners:
            fn(stats)

    # -- drain and resume --------------------------------------------------------------------

    def pause(self) -> None:
        """Stop pulling new messages (running requests go on)."""
        if self.state == WorkerState.SERVING:
            self._set_state(WorkerState.DRAINING)
        self._resume.clear()

    def resume(self) -> None:
        if self.state in (WorkerState.DRAINING, WorkerState.DRAINED):
            self._set_state(WorkerState.SERVING)
        if self.handler is not None:
            self.handler.accepting = True
        self._resume.set()
        self._capacity_changed.set()

    async def drain(self, timeout_s: float) -> int:
        """Stop pulling, let running requests finish for up to timeout_s, requeue the rest.

        Returns how many requests were requeued.
        """
        self.pause()
        assert self.engine is not None and self.handler is not None
        tasks = set(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        left = [t for t in self._tasks if not t.done()]
        if left:
            self.handler.accepting = False
            ids = self.engine.request_ids()
            log.warning("drain timeout: requeueing %d unfinished requests", len(ids))
            self.handler.requeue_ids.update(ids)
            for rid in ids:
                self.engine.abort(rid)
            await asyncio.wait(left, timeout=30)
        self._set_state(WorkerState.DRAINED)
        return len(left)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: aborted at the next step if it runs here (True), otherwise
        remembered so that its message is answered 'cancelled' when it arrives."""
        assert self.engine is not None and self.handler is not None
        if self.engine.is_running(request_id):
            self.engine.abort(request_id)
            return True
        self.handler.remember_cancelled(request_id)
        return False

    def describe(self) -> dict[str, object]:
        """What `kvflow workers` shows for this worker."""
        rec = self.worker_record()
        return {
            "worker": rec.id,
            "state": rec.state,
            "host": rec.host,
            "pid": rec.pid,
            "device": rec.device,
            "model": rec.model,
            "queue": rec.queue,
            "running": rec.running,
            "waiting": rec.waiting,
            "held": len(self._tasks),
            "kv_usage": rec.kv_usage,
            "tokens_per_s": rec.tokens_per_s,
            "uptime_s": time.time() - self.started_at,
        }

    # -- heartbeats ----------------------------------------------------------------------------

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.time()
        recent = [(t, n) for t, n in self._tok_window if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0][0], 1e-6)
        return sum(n for _, n in recent) / span

    def worker_record(self) -> WorkerRecord:
        assert self.engine is not None
        cap = self.engine.capacity()
        info = self.engine.info
        return WorkerRecord(
            id=self.worker_id,
            state=self.state.value if self.state != WorkerState.STARTING else "serving",
            host=socket.gethostname(),
            pid=os.getpid(),
            device=info.device,
            model=info.model_name,
            queue=self.config.queue,
            started_at=datetime.fromtimestamp(self.started_at, UTC),
            running=cap.running,
            waiting=cap.waiting,
            kv_usage=cap.kv_usage,
            tokens_per_s=self.tokens_per_s(),
            info={
                "held": len(self._tasks),
                "max_num_seqs": self.engine_config.max_num_seqs,
                "heartbeat_s": self.config.heartbeat_s,
            },
        )

    async def _heartbeat_once(self) -> None:
        if self.ledger is None or self.engine is None:
            return
        try:
            await self.ledger.heartbeat(self.worker_record())
        except Exception as e:  # a missed heartbeat is harmless
            log.debug("heartbeat failed: %s", e)

    async def _heartbeats(self) -> None:
        while True:
            await self._heartbeat_once()
            await asyncio.sleep(self.config.heartbeat_s)
