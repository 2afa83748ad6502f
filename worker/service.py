"""`kvflow worker`: one worker process, its parts started in order and stopped in reverse.

The parts, in the order a delivery meets them (`worker/serving/`): the `Intake` pulls a
message when the engine can place it, `Delivery` decodes, admits and streams it,
`Settlement` commits its ledger row, sends the final reply and acks. `DrainState` is
the one place that says whether the worker takes new work. The service wires them to
the engine (its own process), the broker, the ledger, the metrics and the control plane,
and runs the lifecycle: start, serve, drain on SIGTERM/SIGINT (no more pulls, running
requests finish up to the drain timeout, the rest is requeued, never dead-lettered), stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
import uuid
from collections import deque
from datetime import UTC, datetime

from aio_pika.abc import AbstractConnection

from broker.connection import connect
from broker.topology import Topology, declare, redact_url
from worker.config import EngineConfig, ServiceConfig
from worker.control import ControlListener
from worker.engine.async_engine import AsyncEngine, EngineFront
from worker.engine.engine import LLMEngine
from worker.engine.outputs import StepStats
from worker.engine.process_engine import ProcessEngine
from worker.ledger import LedgerStore, WorkerRecord, WorkerState
from worker.metrics import Metrics
from worker.serving.drain import DrainState, GiveBack
from worker.serving.wiring import Serving, Wiring, wire

log = logging.getLogger(__name__)

# Tracked allocations between young-generation collections while serving (Python's
# default is 700): requests allocate and drop thousands of small objects a second.
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once started, keep the cyclic garbage collector off the start-up heap.

    What the worker process holds once it is up (modules, torch's and the clients'
    objects: ~240k of them) lives as long as the process; frozen, a full collection
    no longer walks it. Under 4,000 one-token requests (ops/bench/pipeline.py, 2-layer
    model) the collector took 0.25 s of the event loop by default, one full collection
    0.14 s of it, and 0.002 s with the heap frozen and young collections every 10,000
    allocations. Only for a worker whose engine runs in its own process: an engine
    object handed in (tests) would be frozen with everything it refers to.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Service:
    """One worker process (implements `worker.control.Controlled`)."""

    def __init__(
        self, engine_config: EngineConfig, config: ServiceConfig, *, llm: LLMEngine | None = None
    ) -> None:
        self.engine_config = engine_config
        self.config = config
        self.worker_id = config.worker_id or default_worker_id()
        self.drain_timeout_s = config.drain_timeout_s
        self.topology = Topology(queue=config.queue, delivery_limit=config.delivery_limit)
        self.state = WorkerState.STARTING
        self.started_at = time.time()
        self.drain_state = DrainState()
        self.failure: str | None = None
        self._llm = llm  # an engine object handed in runs in a thread of this process
        self._stop = asyncio.Event()
        self._tok_window: deque[tuple[float, int]] = deque(maxlen=256)
        self.metrics: Metrics | None = None
        self.engine: EngineFront | None = None
        self.serving: Serving | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        cfg = self.config
        ledger = await LedgerStore.open(cfg.database_url)
        connection: AbstractConnection | None = None
        engine: AsyncEngine | ProcessEngine | None = None
        try:
            connection = await connect(
                cfg.amqp_url, robust=True, name=f"kvflow-worker {self.worker_id}"
            )
            consume = await connection.channel(publisher_confirms=False)
            publish = await connection.channel(publisher_confirms=True)
            declared = await declare(publish, self.topology)
            # The step loop runs in its own process (no GIL shared with this event loop)
            # unless an engine object was handed in (tests).
            if self._llm is not None:
                engine = AsyncEngine(self._llm)
            else:
                engine = await ProcessEngine.launch(self.engine_config)
            self.engine = engine
            metrics = self.metrics = self._start_metrics(engine.info.model_name, ledger)
            serving = await wire(
                Wiring(
                    connection,
                    consume,
                    publish,
                    declared.queue.name,
                    self.topology,
                    engine,
                    ledger,
                    metrics,
                    self.drain_state,
                    self.engine_config,
                    cfg,
                    self.worker_id,
                )
            )
            self.serving = serving
            intake = serving.intake
            engine.add_stats_listener(self._on_step)
            engine.on_failure = self._engine_failed
            await engine.start()
            control = ControlListener(
                self, publish, serving.replier.publisher, self.topology.control_exchange
            )
            await control.start()
            self._install_signals()
            if self._llm is None:
                settle_heap()
            self._set_state(WorkerState.SERVING)
            self.drain_state.resume()
            log.info(
                "worker %s serving %s (%s on %s): broker %s",
                self.worker_id,
                cfg.queue,
                engine.info.model_name,
                engine.info.device,
                redact_url(cfg.amqp_url),
            )
            beat = asyncio.create_task(self._heartbeats(ledger), name="heartbeat")
            pulling = asyncio.create_task(intake.run(), name="intake")
            pulling.add_done_callback(self._intake_done)
            await self._stop.wait()
            await serving.stop_routing()
            intake.stop()
            try:
                await asyncio.wait_for(pulling, 15)
            except TimeoutError:
                log.warning("the intake did not stop within 15 s")
            await self.drain(cfg.drain_timeout_s)
            await serving.acker.flush()  # acks of the last settlements, before the close
            self._set_state(WorkerState.STOPPED)
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await self._heartbeat_once(ledger)
            return 1 if self.failure is not None else 0
        finally:
            if engine is not None:
                await engine.stop()
            left = await ledger.close()
            if left:
                log.error("%d ledger writes were not committed at exit", left)
            if connection is not None:
                await connection.close()

    def _start_metrics(self, model: str, ledger: LedgerStore) -> Metrics:
        m = Metrics(
            self.worker_id, model, clients=[c for c, _ in self.engine_config.client_weights]
        )
        m.watch_ledger(
            lambda: ledger.pending,
            lambda: (ledger.write_latency.count, ledger.write_latency.total_s),
            lambda: ledger.errors,
        )
        if self.config.metrics_port is not None:
            m.serve(self.config.metrics_host, self.config.metrics_port)
            log.info("metrics on %s:%d/metrics", self.config.metrics_host, self.config.metrics_port)
        return m

    def _set_state(self, state: WorkerState) -> None:
        self.state = state
        if self.metrics is not None:
            self.metrics.set_state(state.value, tuple(s.value for s in WorkerState))

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does)."""
        if not self._stop.is_set():
            log.info("worker %s: shutting down, draining", self.worker_id)
            self._stop.set()

    def _engine_failed(self, error: str, request_ids: list[str]) -> None:
        """The engine died: its requests go back to the queue as crash suspects (another
        worker, or this one restarted, runs each alone; one that kills the engine again
        when alone ends failed), and the worker stops with a non-zero exit code."""
        log.error(
            "worker %s: engine failed (%s); requeueing %d requests and stopping",
            self.worker_id,
            error,
            len(request_ids),
        )
        self.failure = error
        self.drain_state.give_back(request_ids, GiveBack.CRASHED)
        self.request_stop()

    def _intake_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            # Without its intake the worker would heartbeat 'serving' and never pull again.
            log.error("the intake stopped unexpectedly; shutting down", exc_info=task.exception())
            self.failure = self.failure or f"intake failed: {task.exception()!r}"
        self.request_stop()  # stopped, failed, or a burst that emptied the queue

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)

    def _on_step(self, stats: StepStats) -> None:
        self._tok_window.append(
            (time.time(), stats.num_decode_tokens + (1 if stats.num_prefill_tokens else 0))
        )
        serving = self.serving
        if serving is not None:
            serving.intake.capacity_changed()
        if self.metrics is not None:
            self.metrics.on_step(stats)

    # -- what the control plane can ask (worker.control.Controlled) ------------------------

    def pause(self) -> None:
        """Stop pulling new messages (running requests go on)."""
        if self.state == WorkerState.SERVING:
            self._set_state(WorkerState.DRAINING)
        self.drain_state.pause()

    def resume(self) -> None:
        if self.state in (WorkerState.DRAINING, WorkerState.DRAINED):
            self._set_state(WorkerState.SERVING)
        self.drain_state.resume()
        if self.serving is not None:
            self.serving.intake.capacity_changed()

    async def drain(self, timeout_s: float) -> int:
        """Stop pulling, let running requests finish for up to timeout_s, requeue the rest.

        Returns how many requests were requeued.
        """
        self.pause()
        assert self.engine is not None and self.serving is not None
        intake = self.serving.intake
        left = await intake.wait_settled(timeout_s)
        if left:
            ids = self.engine.request_ids()
            log.warning("drain timeout: requeueing %d unfinished requests", len(ids))
            self.drain_state.give_back(ids)
            for rid in ids:
                self.engine.abort(rid)
            await intake.wait_settled(30)
        self._set_state(WorkerState.DRAINED)
        return left

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: aborted at the next step if it runs here (True), otherwise
        remembered so that its message is answered 'cancelled' when it arrives."""
        assert self.engine is not None
        if self.engine.is_running(request_id):
            self.engine.abort(request_id)
            return True
        self.drain_state.cancel_on_arrival(request_id)
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
            "held": self.serving.intake.held if self.serving else 0,
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
            state=self.state.recorded,
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
                "held": self.serving.intake.held if self.serving else 0,
                "routed": self.serving.router.routed if self.serving and self.serving.router else 0,
                "max_num_seqs": self.engine_config.max_num_seqs,
                "heartbeat_s": self.config.heartbeat_s,
            },
        )

    async def _heartbeat_once(self, ledger: LedgerStore) -> None:
        if self.engine is None:
            return
        try:
            await ledger.heartbeat(self.worker_record())
        except Exception as e:  # a missed heartbeat is harmless
            log.debug("heartbeat failed: %s", e)

    async def _heartbeats(self, ledger: LedgerStore) -> None:
        while True:
            await self._heartbeat_once(ledger)
            await asyncio.sleep(self.config.heartbeat_s)
