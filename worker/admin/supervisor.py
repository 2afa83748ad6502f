"""`kvflow up`: keep N `kvflow worker` processes running on this machine.

- Each worker is a child process `python -m worker.cli worker <worker args>` with its own
  id (`<host>-up<supervisor pid>-<n>`); with devices given, each gets
  CUDA_VISIBLE_DEVICES set to the least used device. Broker, ledger and queue reach the
  children through the environment (KVFLOW_AMQP_URL, ...), never the command line,
  where `ps` would show a password.
- A child that exits without being asked to is restarted, after a delay that doubles
  (up to 30 s) while children keep dying within 30 s of their start.
- The supervisor listens on the control exchange for `scale` commands addressed to
  target "supervisor" (and, when the command names a queue, to its queue): it answers
  "ack" at once and "done" when the change is complete. Scaling up is done when every
  new worker answers a ping (or died); scaling down stops the newest workers first,
  each with SIGTERM, which the worker treats as a graceful drain (finish running work
  up to its drain timeout, requeue the rest, exit 0), and is done when they exited.
- SIGTERM or SIGINT stops every worker the same way, then the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from broker.connection import connect
from broker.control import SUPERVISOR, ControlCommand, ControlReply
from broker.publisher import ReplyPublisher
from broker.topology import Topology
from worker.admin.control_client import ControlClient

log = logging.getLogger(__name__)

# Set by the supervisor itself; a worker argument naming them would be ambiguous.
RESERVED_ARGS = ("--amqp-url", "--database-url", "--queue", "--worker-id")
MAX_WORKERS = 256


@dataclass(frozen=True)
class SupervisorConfig:
    """What `kvflow up` was asked to run."""

    workers: int
    amqp_url: str
    queue: str
    database_url: str | None = None
    devices: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    stop_timeout_s: float = 120.0  # SIGTERM -> SIGKILL; above the worker's drain timeout
    ready_timeout_s: float = 120.0
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be between 0 and {MAX_WORKERS}, got {self.workers}")
        for arg in self.worker_args:
            name = arg.split("=", 1)[0]
            if name in RESERVED_ARGS:
                raise ValueError(
                    f"{name} is set by `kvflow up` itself: give it before `--`, not after"
                )
        if any(not d.strip() for d in self.devices):
            raise ValueError(f"devices must be non-empty names, got {list(self.devices)}")


@dataclass
class Child:
    id: str
    seq: int
    device: str | None
    proc: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False


class Supervisor:
    """Owns the worker processes of one `kvflow up`."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.topology = Topology(queue=config.queue)
        self.id = f"{SUPERVISOR}:{socket.gethostname()}:{os.getpid()}"
        self.target = config.workers
        self.children: dict[str, Child] = {}
        self._seq = 0
        self._crashes = 0
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: ControlClient | None = None
        self._publisher: ReplyPublisher | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> int:
        """Start the workers, obey scale commands until SIGTERM/SIGINT; returns 0."""
        cfg = self.config
        connection = await connect(cfg.amqp_url, robust=True, name=f"kvflow {self.id}")
        try:
            channel = await connection.channel(publisher_confirms=True)
            self._publisher = ReplyPublisher(channel)
            exchange = await channel.declare_exchange(
                self.topology.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True
            )
            listen = await channel.declare_queue("", exclusive=True, auto_delete=True)
            await listen.bind(exchange)
            await listen.consume(self._on_command, no_ack=True)
            self._control = await ControlClient.open(cfg.amqp_url, self.topology)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            log.info(
                "%s: keeping %d workers on queue %s%s",
                self.id,
                self.target,
                cfg.queue,
                f" over devices {','.join(cfg.devices)}" if cfg.devices else "",
            )
            async with self._lock:
                await self._scale_to(self.target)
            await self._stop.wait()
            log.info("%s: stopping %d workers", self.id, len(self.children))
            async with self._lock:
                self.target = 0
                await self._scale_to(0)
            return 0
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for child in list(self.children.values()):  # only on an error path
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
            if self._control is not None:
                await self._control.close()
            await connection.close()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- children ------------------------------------------------------------------------

    def live(self) -> list[Child]:
        return sorted((c for c in self.children.values() if not c.stopping), key=lambda c: c.seq)

    def _pick_device(self) -> str | None:
        devices = self.config.devices
        if not devices:
            return None
        load = {d: 0 for d in devices}
        for c in self.live():
            if c.device in load:
                load[c.device] += 1
        return min(devices, key=lambda d: load[d])

    async def _start_child(self) -> Child:
        cfg = self.config
        self._seq += 1
        wid = f"{socket.gethostname()}-up{os.getpid()}-{self._seq}"
        device = self._pick_device()
        env = dict(os.environ)
        env.update({"KVFLOW_AMQP_URL": cfg.amqp_url, "KVFLOW_QUEUE": cfg.queue})
        env["KVFLOW_WORKER_ID"] = wid
        if cfg.database_url:
            env["KVFLOW_DATABASE_URL"] = cfg.database_url
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        argv = [cfg.python, "-m", "worker.cli", "worker", *cfg.worker_args]
        proc = await asyncio.create_subprocess_exec(*argv, env=env)
        child = Child(wid, self._seq, device, proc)
        self.children[wid] = child
        log.info(
            "started worker %s (pid %d%s)",
            wid,
            proc.pid,
            f", CUDA_VISIBLE_DEVICES={device}" if device is not None else "",
        )
        self._spawn_task(self._watch(child))
        return child

    async def _watch(self, child: Child) -> None:
        code = await child.proc.wait()
        if child.stopping or self._stop.is_set():
            return
        self.children.pop(child.id, None)
        lived = time.monotonic() - child.started
        self._crashes = self._crashes + 1 if lived < 30 else 0
        delay = min(0.5 * 2**self._crashes, 30.0)
        log.warning(
            "worker %s exited unexpectedly (code %s after %.0f s); restarting in %.1f s",
            child.id,
            code,
            lived,
            delay,
        )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)
        if self._stop.is_set():
            return
        async with self._lock:
            if len(self.live()) < self.target:
                await self._start_child()

    async def _stop_child(self, child: Child) -> str:
        child.stopping = True
        if child.proc.returncode is None:
            log.info("stopping worker %s (SIGTERM: drain, then exit)", child.id)
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                log.error(
                    "worker %s still running %.0f s after SIGTERM: killing it",
                    child.id,
                    self.config.stop_timeout_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()
        self.children.pop(child.id, None)
        log.info("worker %s stopped (code %s)", child.id, child.proc.returncode)
        return child.id

    async def _scale_to(self, n: int) -> tuple[list[str], list[str]]:
        """Start or stop (newest first) workers until `n` run; (started, stopped) ids."""
        live = self.live()
        if len(live) < n:
            started = [(await self._start_child()).id for _ in range(n - len(live))]
            return started, []
        victims = sorted(live, key=lambda c: c.seq, reverse=True)[: len(live) - n]
        stopped = await asyncio.gather(*(self._stop_child(c) for c in victims))
        return [], list(stopped)

    async def _ready(self, wid: str) -> bool:
        """Wait until worker `wid` answers a ping; False if it died or timed out."""
        assert self._control is not None
        until = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < until and not self._stop.is_set():
            child = self.children.get(wid)
            if child is None or child.proc.returncode is not None:
                return False
            try:
                replies = await self._control.call(
                    ControlCommand("ping", target=wid), timeout=1.0, enough=bool
                )
            except Exception as e:  # the broker went away: the worker is not known ready
                log.warning("could not ping worker %s: %s", wid, e)
                return False
            if replies:
                return True
        return False

    # -- the control plane -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "supervisor": self.id,
            "queue": self.config.queue,
            "target": self.target,
            "workers": [c.id for c in self.live()],
            "devices": {c.id: c.device for c in self.live() if c.device is not None},
        }

    async def _on_command(self, message: AbstractIncomingMessage) -> None:
        try:
            cmd = ControlCommand.decode(message.body)
        except ValueError:
            return
        queue = cmd.args.get("queue")
        if cmd.target != SUPERVISOR or (queue is not None and queue != self.config.queue):
            return
        if cmd.cmd == "ping":
            await self._reply(message.reply_to, cmd, info=self.describe())
        elif cmd.cmd == "scale":
            self._spawn_task(self._scale(cmd, message.reply_to))

    async def _scale(self, cmd: ControlCommand, reply_to: str | None) -> None:
        try:
            n = int(cmd.args.get("workers", -1))
            if not 0 <= n <= MAX_WORKERS:
                raise ValueError(f"workers must be between 0 and {MAX_WORKERS}, got {n}")
        except (TypeError, ValueError) as e:
            await self._reply(reply_to, cmd, ok=False, error=str(e))
            return
        before = len(self.live())
        await self._reply(reply_to, cmd, info={**self.describe(), "from": before, "to": n})
        log.info("%s: scale %d -> %d", self.id, before, n)
        try:
            async with self._lock:
                self.target = n
                started, stopped = await self._scale_to(n)
                ready = await asyncio.gather(*(self._ready(w) for w in started))
        except Exception as e:
            log.exception("scale to %d failed", n)
            await self._reply(reply_to, cmd, ok=False, event="done", error=str(e))
            return
        not_ready = [w for w, ok in zip(started, ready, strict=True) if not ok]
        info = {**self.describe(), "from": before, "to": n, "started": started}
        info |= {"stopped": stopped, "not_ready": not_ready}
        error = f"workers not ready: {', '.join(not_ready)}" if not_ready else None
        await self._reply(reply_to, cmd, ok=not not_ready, event="done", info=info, error=error)

    async def _reply(
        self,
        reply_to: str | None,
        cmd: ControlCommand,
        *,
        ok: bool = True,
        event: str = "ack",
        info: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        if not reply_to or self._publisher is None:
            return
        reply = ControlReply(cmd.id, self.id, cmd.cmd, ok, event, info or {}, error)
        try:
            await self._publisher.publish(reply_to, cmd.id, reply.encode())
        except Exception as e:  # the CLI may be gone; the command still took effect
            log.debug("scale reply to %s failed: %s", reply_to, e)
