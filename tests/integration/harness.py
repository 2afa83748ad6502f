"""The queue worker's test world: worker subprocesses, their queues and ledger schema, a
recording client, and samplers of what each worker holds.

Every test gets its own `test.<hex>` queues (the `rabbit_topology` fixture, pointed at
by KVFLOW_EXCHANGE and --queue) and its own migrated ledger schema, starts the workers
it needs, waits for their first heartbeat row in `workers`, and stops them afterwards.
Workers run with the engine's test hook: a request whose prompt holds `HOLD` sits still
after its first token while the harness's gate is closed (`Harness.hold`/`release`).

Flow-control checks rest on one fact of the worker: a request's ledger row turns
`running` after its message was pulled and turns terminal before the message is
acked, so the number of `running` rows of a worker never exceeds the number of
messages it holds unacknowledged. Sampling those rows is a sound lower bound of what
a worker holds; the heartbeat's `info.held` and `rabbitmqctl` (5 s late on quorum
queues) are sampled too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from sqlalchemy import func, select

from broker.client import Client, Handle
from broker.messages import CONTENT_TYPE, decode_reply
from broker.topology import Topology
from tests.integration.helpers import eventually
from worker.admin.queues import queue_counts
from worker.config import parse_weights
from worker.ledger.migrate import open_engine
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table
from worker.serving.lanes import Lanes

REPO = Path(__file__).resolve().parents[2]
LOOKAHEAD = 2
HOLD = 49151  # the last id of the default model's vocabulary (and the tiny models')
HEARTBEAT_S = 0.2  # KVFLOW_HEARTBEAT_S for the workers: fine-grained `workers` samples
READY_TIMEOUT_S = 90.0


def seconds(a: datetime, b: datetime) -> float:
    """b - a in seconds."""
    return (b - a).total_seconds()


# -- the client side --


class RecordingClient(Client):
    """The product's client, also keeping every raw reply per request id, in order.

    The client itself drops what arrives after a request's final reply; the tests need
    to see it (a second result, a delta after the result, errors for raw publishes).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: dict[str, list[dict[str, Any]]] = defaultdict(list)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        with contextlib.suppress(ValueError):
            reply = decode_reply(message.body)
            self.replies[str(reply.get("id") or message.correlation_id)].append(reply)
        await super()._on_reply(message)

    def kinds(self, rid: str) -> list[str]:
        return [r["type"] for r in self.replies.get(rid, [])]


# -- worker processes --


@dataclasses.dataclass
class WorkerProc:
    """One `kvflow worker` subprocess; its stdout and stderr go to `log_path`."""

    id: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def output(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait(self, timeout: float) -> int:
        """The exit code; fails the test if the process is still running after `timeout`."""
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {self.id} still running after {timeout} s:\n{self.tail()}")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; always reaps the process and closes the log."""
        try:
            if self.alive():
                self.proc.terminate()
                try:
                    await asyncio.to_thread(self.proc.wait, 15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 15)
        finally:
            self.log_file.close()


def worker_command(
    amqp_url: str,
    queue: str,
    database_url: str,
    worker_id: str,
    *,
    model: Path | None,
    max_num_seqs: int,
    num_kv_blocks: int = 256,
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--amqp-url", amqp_url]
    cmd += ["--queue", queue, "--database-url", database_url, "--worker-id", worker_id]
    if model is not None:
        cmd += ["--model", str(model)]
    cmd += ["--num-kv-blocks", str(num_kv_blocks), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--lookahead", str(LOOKAHEAD), "--threads", "1", *extra]
    return cmd


def spawn(
    cmd: list[str],
    worker_id: str,
    log_dir: Path,
    exchange: str,
    hooks: dict[str, Any] | None = None,
    extra_env: dict[str, str] | None = None,
) -> WorkerProc:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env |= {
        "KVFLOW_EXCHANGE": exchange,
        "KVFLOW_HEARTBEAT_S": str(HEARTBEAT_S),
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    if hooks:  # the engine's test hooks (worker/engine/faults.py)
        env["KVFLOW_TEST_HOOKS"] = json.dumps(hooks)
    env |= extra_env or {}
    if "KVFLOW_CACHE_DIR" in os.environ:  # the default model's conversion cache
        env["KVFLOW_CACHE_DIR"] = os.environ["KVFLOW_CACHE_DIR"]
    log_path = log_dir / f"{worker_id}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed by WorkerProc.stop
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return WorkerProc(worker_id, proc, log_path, log_file)


def lane_queues(queue: str, args: Sequence[str]) -> set[str]:
    """Fair mode's lanes for a worker started with `args` (none without --client-weights)."""
    if "--client-weights" not in args:
        return set()
    weights = parse_weights(args[list(args).index("--client-weights") + 1])
    return set(Lanes(queue, dict(weights)).queues)


# -- the harness: queues, ledger, client, workers --


class Harness:
    """One test's world: topology, migrated ledger schema, a client, worker processes."""

    def __init__(self, amqp_url: str, topo: Topology, db_url: str, log_dir: Path) -> None:
        self.amqp_url = amqp_url
        self.topo = topo
        self.db_url = db_url
        self.log_dir = log_dir
        self.db = open_engine(db_url)
        self.workers: list[WorkerProc] = []
        self.gate = log_dir / "hold-gate"
        # Queues the test's workers and helpers declare beyond the topology's (fair
        # mode's lanes, a stress test's reply queue): deleted with it, so that quorum
        # queues do not pile up on the broker (each one slows its restart).
        self.queues: set[str] = {f"{topo.queue}.replies"}

    def hold(self) -> None:
        """From now on, requests whose prompt holds HOLD stop after their first token."""
        self.gate.touch()

    def release(self) -> None:
        """Let held requests go on."""
        self.gate.unlink(missing_ok=True)

    async def open(self) -> None:
        self.client = await RecordingClient.connect(self.amqp_url, topology=self.topo)
        self.connection = await aio_pika.connect(self.amqp_url, timeout=10)
        self.channel = await self.connection.channel()
        self.exchange = await self.channel.get_exchange(self.topo.exchange, ensure=False)
        self.dead = await self.channel.get_queue(self.topo.dead_letter_queue, ensure=False)

    async def close(self) -> None:
        try:
            await asyncio.gather(*(w.stop() for w in self.workers))
        finally:
            with contextlib.suppress(Exception):
                await self.client.close()
            with contextlib.suppress(Exception):
                await self.connection.close()
            with contextlib.suppress(Exception):
                await self._delete_queues()
            await self.db.dispose()

    async def _delete_queues(self) -> None:
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        try:
            for name in sorted(self.queues):
                with contextlib.suppress(Exception):  # one failed delete skips no other
                    channel = await connection.channel()
                    await channel.queue_delete(name)
                    await channel.close()
        finally:
            await connection.close()

    # workers

    def start(
        self,
        name: str,
        *,
        model: Path | None,
        max_num_seqs: int,
        num_kv_blocks: int = 256,
        extra: Sequence[str] = (),
        database_url: str | None = None,
        amqp_url: str | None = None,
        crash_token: int | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProc:
        """A worker; a request whose prompt holds HOLD sits still after its first token
        while the gate is closed, one holding `crash_token` kills its engine process."""
        wid = f"{name}-{uuid.uuid4().hex[:6]}"
        self.queues |= lane_queues(self.topo.queue, extra)
        cmd = worker_command(
            amqp_url or self.amqp_url,
            self.topo.queue,
            database_url or self.db_url,
            wid,
            model=model,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            extra=extra,
        )
        hooks: dict[str, Any] = {"hold_token": HOLD, "gate": str(self.gate)}
        if crash_token is not None:
            hooks["crash_token"] = crash_token
        w = spawn(cmd, wid, self.log_dir, self.topo.exchange, hooks, env)
        self.workers.append(w)
        return w

    async def ready(self, *workers: WorkerProc) -> None:
        """Wait (bounded) for each worker's heartbeat row; fail at once if one exits."""

        async def beating() -> bool:
            for w in workers:
                if not w.alive():
                    pytest.fail(f"worker {w.id} exited with {w.proc.returncode}:\n{w.tail()}")
            rows = await self.worker_rows()
            return all(w.id in rows for w in workers)

        await eventually(beating, "the workers' first heartbeats", timeout=READY_TIMEOUT_S)

    # the ledger

    async def rows(self, ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        stmt = select(requests_table)
        if ids is not None:
            stmt = stmt.where(requests_table.c.id.in_(list(ids)))
        async with self.db.connect() as conn:
            result = (await conn.execute(stmt)).mappings().all()
        return {r["id"]: dict(r) for r in result}

    async def count_rows(self) -> int:
        async with self.db.connect() as conn:
            n = await conn.scalar(select(func.count()).select_from(requests_table))
        return int(n or 0)

    async def running_by_worker(self) -> dict[str, int]:
        t = requests_table.c
        stmt = select(t.worker_id, func.count()).where(t.status == "running").group_by(t.worker_id)
        async with self.db.connect() as conn:
            return {wid: int(n) for wid, n in (await conn.execute(stmt)).all()}

    async def worker_rows(self) -> dict[str, dict[str, Any]]:
        async with self.db.connect() as conn:
            result = (await conn.execute(select(workers_table))).mappings().all()
        return {r["id"]: dict(r) for r in result}

    async def settled(self, ids: Sequence[str], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
        """Wait until every id has a terminal ledger row; returns the rows."""

        async def done() -> dict[str, dict[str, Any]] | None:
            rows = await self.rows(ids)
            ok = len(rows) == len(ids) and all(
                r["status"] not in ("queued", "running") for r in rows.values()
            )
            return rows if ok else None

        rows: dict[str, dict[str, Any]] = await eventually(
            done, f"{len(ids)} terminal ledger rows", timeout=timeout
        )
        return rows

    # the broker

    async def submit_long(
        self, prefix: str, n: int, max_tokens: int, held: bool = False
    ) -> list[Handle]:
        """n requests `<prefix>-<i>` of exactly `max_tokens` tokens each (`held`: marked
        to sit still while the gate is closed)."""
        return [
            await self.client.submit(
                prompt_token_ids=[HOLD] * held + [5, 6, 7 + i],
                id=f"{prefix}-{i}",
                max_tokens=max_tokens,
                ignore_eos=True,
            )
            for i in range(n)
        ]

    async def ready_count(self) -> int:
        declared = await self.channel.declare_queue(self.topo.queue, passive=True)
        return int(declared.declaration_result.message_count or 0)

    async def publish_raw(
        self,
        body: bytes,
        rid: str,
        *,
        headers: dict[str, Any] | None = None,
        **props: Any,
    ) -> None:
        """Publish a request body as-is (no client-side checks), replies to our client."""
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=rid,
            correlation_id=rid,
            reply_to=self.client.reply_queue,
            headers=headers,
            **props,
        )
        await self.exchange.publish(message, routing_key=self.topo.queue, mandatory=True)

    async def dead_letters(self, ids: set[str], timeout: float = 20.0) -> dict[str, bytes]:
        """Read `<queue>.dead` until every id in `ids` showed up; returns id -> body."""
        found: dict[str, bytes] = {}

        async def drained() -> bool:
            while (m := await self.dead.get(no_ack=True, fail=False)) is not None:
                assert m.message_id not in found, f"{m.message_id} dead-lettered twice"
                found[str(m.message_id)] = m.body
            return ids <= found.keys()

        await eventually(drained, f"dead letters {sorted(ids - found.keys())}", timeout=timeout)
        return found

    async def dead_letter_count(self) -> int:
        declared = await self.channel.declare_queue(self.topo.dead_letter_queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


# -- samplers --


class HeldSampler:
    """Samples what each worker holds: `running` ledger rows (a lower bound of its unacked
    messages, see the module docstring), the heartbeat's `info.held`, and the queue's
    ready count; every `every` seconds while running."""

    def __init__(self, h: Harness, every: float = 0.03) -> None:
        self.h = h
        self.every = every
        self.max_running: dict[str, int] = defaultdict(int)
        self.max_held: dict[str, int] = defaultdict(int)
        self.ready: list[tuple[float, int]] = []
        self.samples = 0
        self._task: asyncio.Task[None] | None = None
        # Stopped between samples, never cancelled: a cancelled passive declare closes the
        # harness's shared channel (aiormq closes a channel whose RPC was cancelled), and
        # the test's next broker call on it fails.
        self._stop = asyncio.Event()

    async def _loop(self) -> None:
        while not self._stop.is_set():
            for wid, n in (await self.h.running_by_worker()).items():
                self.max_running[wid] = max(self.max_running[wid], n)
            for wid, row in (await self.h.worker_rows()).items():
                held = int((row["info"] or {}).get("held", 0))
                self.max_held[wid] = max(self.max_held[wid], held)
            self.ready.append((time.monotonic(), await self.h.ready_count()))
            self.samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every)

    async def __aenter__(self) -> HeldSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._stop.set()
        done, _ = await asyncio.wait({self._task}, timeout=30)
        if not done:  # a sample stuck on a broker gone away: cancel it after all
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            return
        self._task.result()  # re-raise a sampler failure


class UnackedSampler:
    """The broker's own unacked count (`rabbitmqctl`, ~5 s late on quorum queues)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.unacked: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            _, unacked = await queue_counts(self.h.amqp_url, self.h.topo.queue)
            self.unacked.append(unacked)
            await asyncio.sleep(0.3)

    async def __aenter__(self) -> UnackedSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def results(handles: Sequence[Handle], timeout: float) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(h.result(timeout) for h in handles)))
