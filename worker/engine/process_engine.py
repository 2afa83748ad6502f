"""The engine's step loop in a child process, behind the same asyncio front.

Why a process: the queue worker's event loop (AMQP frames, ledger writes, replies) and
the step loop's Python glue would otherwise take turns on one GIL; each handover costs
the other side a wait. In separate processes they only share CPU.

The child is started with `spawn` (a fresh interpreter: safe with torch's threads), loads
the model, and runs the same StepDriver as the in-thread engine, reading commands from a
pipe and writing one StepReport per step back. It ignores SIGINT/SIGTERM (the parent
drains first, then stops it) and exits when the parent's end of the pipe closes, so a
killed worker never leaves its engine behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from broker.turns import EndOfTurn
from worker.config import EngineConfig
from worker.engine.async_engine import EngineFront
from worker.engine.engine import Capacity, LLMEngine
from worker.engine.model_runner import RuntimeInfo
from worker.engine.step_driver import Command, StepDriver, StepReport, Stop
from worker.limits import RequestLimits
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # a first start may convert the GGUF model


def _child(config: EngineConfig, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    try:
        engine = LLMEngine(config)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.info, engine.limits, engine.capacity(), str(engine.loaded.path)))

    def next_commands(block: bool) -> list[Command]:
        cmds: list[Command] = []
        try:
            if block:
                cmds.extend(conn.recv())
            while conn.poll():
                cmds.extend(conn.recv())  # the parent sends lists of commands
        except (EOFError, OSError):  # the parent is gone
            cmds.append(Stop())
        return cmds

    def report(r: StepReport) -> None:
        # If the parent is gone, the next read of commands stops the loop.
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send(r)

    StepDriver(engine, next_commands, report).run()


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for a child about to be started, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ProcessEngine(EngineFront):
    """Runs an LLMEngine in a child process; create with `await ProcessEngine.launch(cfg)`."""

    def __init__(
        self,
        info: RuntimeInfo,
        limits: RequestLimits,
        tokenizer: Tokenizer,
        capacity: Capacity,
        process: multiprocessing.process.BaseProcess,
        conn: Connection,
    ) -> None:
        super().__init__(info, limits, tokenizer, capacity)
        self._process = process
        self._conn = conn
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        # Commands of one event-loop turn go down the pipe as one message: a burst of
        # deliveries costs one pickle and one write, not one each. While other callbacks
        # are ready (a burst spread over a few turns) the message waits for them, a few
        # turns at most (broker.turns.EndOfTurn, as the AMQP socket's writes do); an idle
        # loop sends at once.
        self._outbox: list[Command] = []
        self._end: EndOfTurn | None = None

    @classmethod
    async def launch(
        cls, config: EngineConfig, timeout_s: float = STARTUP_TIMEOUT_S
    ) -> ProcessEngine:
        """Start the engine process and wait until its model is loaded."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_child, args=(config, child), name="kvflow-engine", daemon=True
        )
        # Idle OpenMP threads spin only briefly before they sleep. The engine shares the
        # cores with the event loop, the broker and the database: libgomp's default spin
        # (300,000 turns) takes the CPU they need between ops, and on a busy machine it
        # cost 4-5x the CPU per one-token request and halved decode tok/s (measured with
        # an engine microbenchmark under load; see ops/bench/RESULTS.md, "Through the queue"). An
        # operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
        tuned = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
        with _environ(**({} if tuned else {"GOMP_SPINCOUNT": "1000"})):
            process.start()
        child.close()

        def wait_ready() -> tuple[object, ...]:
            if not parent.poll(timeout_s):
                raise TimeoutError(f"the engine process did not start within {timeout_s:.0f} s")
            msg: tuple[object, ...] = parent.recv()
            return msg

        try:
            msg = await asyncio.to_thread(wait_ready)
        except (EOFError, OSError):
            process.join(5)
            raise RuntimeError(
                f"the engine process exited during start-up (code {process.exitcode})"
            ) from None
        except BaseException:
            process.kill()
            raise
        if msg[0] == "error":
            process.join(5)
            raise RuntimeError(f"the engine could not start: {msg[1]}")
        _, info, limits, capacity, path = msg
        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, Path(str(path)))
        return cls(info, limits, tokenizer, capacity, process, parent)  # type: ignore[arg-type]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._end = EndOfTurn(self._loop, self._flush)
        self._running = True
        self._reader = threading.Thread(target=self._read, name="kvflow-engine-reader", daemon=True)
        self._reader.start()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the step loop (running requests are aborted) and the process."""
        if self._running:
            self._send(Stop())
            self._flush()
        await asyncio.to_thread(self._process.join, timeout_s)
        if self._process.is_alive():
            log.warning("engine process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._running = False
        self._conn.close()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)

    async def __aenter__(self) -> ProcessEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _send(self, command: Command) -> None:
        self._outbox.append(command)
        if self._end is None or isinstance(command, Stop):
            self._flush()
        else:
            self._end.arm()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        with self._send_lock, contextlib.suppress(BrokenPipeError, OSError):
            # A broken pipe means the child is gone: the reader reports it.
            self._conn.send(batch)

    def _read(self) -> None:
        error = "the engine process exited"
        while True:
            try:
                r = self._conn.recv()
            except (EOFError, OSError):
                break
            self._post(self._on_report, r)
            if r.stopped:
                if r.error:
                    error = r.error
                else:
                    return
                break
        code = self._process.exitcode
        self._post(self._fail_all, f"{error} (exit code {code})" if code else error)

    def _post(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn, *args)
