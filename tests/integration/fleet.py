"""One integration test's world of real processes: its queues, its ledger schema, `kvflow
worker` / `kvflow up` subprocesses, the `kvflow` CLI, and a gate that holds requests at
a known point.

Tests synchronise on events (ledger rows, replies, heartbeats, control replies), never
on how long a step takes here: `Gate` uses the engine's test hook (worker/engine/faults.py)
so that a request marked with `HOLD_TOKEN` sits still after its first token (keeping its
place in the batch) until the test opens the gate; unmarked requests go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Sequence
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
from worker.ledger.migrate import open_engine
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.2
READY_TIMEOUT_S = 90.0
CLI_TIMEOUT_S = 120.0
HOLD_TOKEN = 4242  # in a prompt, marks a request that a closed gate holds


@dataclasses.dataclass(frozen=True)
class Gate:
    """While `path` exists, a request whose prompt holds HOLD_TOKEN, on a worker started
    with this gate, makes no progress once it has its first token (aborts still apply)."""

    path: Path

    def close(self) -> None:
        self.path.touch()

    def open(self) -> None:
        self.path.unlink(missing_ok=True)

    def env(self) -> dict[str, str]:
        spec = {"hold_token": HOLD_TOKEN, "gate": str(self.path)}
        return {"KVFLOW_TEST_HOOKS": json.dumps(spec)}


async def first_delta(handle: Handle, timeout: float = 60.0) -> dict[str, Any]:
    """Wait for a streamed request's first delta: it is running and has a token."""
    stream = handle.stream(timeout)
    try:
        return await anext(stream)
    finally:
        await stream.aclose()


@dataclasses.dataclass
class Proc:
    """A `kvflow worker` or `kvflow up` subprocess; output goes to `log_path`."""

    name: str
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
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout} s:\n{self.tail()}")

    async def stop(self) -> None:
        """SIGTERM to its process group (a supervisor's workers too), SIGKILL after 30 s."""
        try:
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(self.proc.wait, 30)
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group
                os.killpg(self.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait, 15)
        finally:
            self.log_file.close()


@dataclasses.dataclass(frozen=True)
class Cli:
    """The outcome of one `kvflow ...` run."""

    args: tuple[str, ...]
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.out)
        except ValueError:
            pytest.fail(f"kvflow {' '.join(self.args)}: not JSON:\n{self.out}\n{self.err}")

    def ok(self) -> Cli:
        assert self.code == 0, (
            f"kvflow {' '.join(self.args)} -> {self.code}\n{self.out}\n{self.err}"
        )
        assert "Traceback" not in self.err, self.err
        return self


class Env:
    """One test's world: topology, ledger schema, a client, processes, the CLI."""

    def __init__(
        self, amqp_url: str, topo: Topology, db_url: str, log_dir: Path, model: Path
    ) -> None:
        self.amqp_url = amqp_url
        self.topo = topo
        self.db_url = db_url
        self.log_dir = log_dir
        self.model = model
        self.db = open_engine(db_url)
        self.procs: list[Proc] = []
        self.replies: dict[str, list[dict[str, Any]]] = defaultdict(list)

    async def open(self) -> None:
        self.client = await Client.connect(self.amqp_url, topology=self.topo)
        self.connection = await aio_pika.connect(self.amqp_url, timeout=10)
        self.channel = await self.connection.channel()
        self.exchange = await self.channel.get_exchange(self.topo.exchange, ensure=False)
        # raw publishes get their replies here
        self.reply_queue = await self.channel.declare_queue("", exclusive=True, auto_delete=True)
        await self.reply_queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = decode_reply(message.body)
        self.replies[str(reply.get("id") or message.correlation_id)].append(reply)

    async def close(self) -> None:
        try:
            await asyncio.gather(*(p.stop() for p in self.procs))
        finally:
            with contextlib.suppress(Exception):
                await self.client.close()
            with contextlib.suppress(Exception):
                await self.connection.close()
            await self.db.dispose()

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
        env |= {
            "KVFLOW_EXCHANGE": self.topo.exchange,
            "KVFLOW_QUEUE": self.topo.queue,
            "KVFLOW_AMQP_URL": self.amqp_url,
            "KVFLOW_DATABASE_URL": self.db_url,
            "KVFLOW_HEARTBEAT_S": str(HEARTBEAT_S),
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            **extra,
        }
        return env

    def worker_args(
        self, max_num_seqs: int, extra: Sequence[str] = (), num_kv_blocks: int = 256
    ) -> list[str]:
        return [
            "--model",
            str(self.model),
            "--num-kv-blocks",
            str(num_kv_blocks),
            "--max-num-seqs",
            str(max_num_seqs),
            "--threads",
            "1",
            *extra,
        ]

    def gate(self) -> Gate:
        """A new gate, closed: workers started with it hold a marked request."""
        gate = Gate(self.log_dir / f"gate-{uuid.uuid4().hex[:6]}")
        gate.close()
        return gate

    def _spawn(self, name: str, argv: list[str], gate: Gate | None) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by Proc.stop
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *argv],
            cwd=REPO,
            env=self.env(**(gate.env() if gate else {})),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stop() reaches its children
        )
        p = Proc(name, proc, log_path, log_file)
        self.procs.append(p)
        return p

    def worker(
        self,
        name: str,
        max_num_seqs: int = 2,
        extra: Sequence[str] = (),
        num_kv_blocks: int = 256,
        gate: Gate | None = None,
    ) -> Proc:
        """A `kvflow worker` whose id is `<name>-<hex>` (its Proc's name)."""
        wid = f"{name}-{uuid.uuid4().hex[:6]}"
        argv = ["worker", "--worker-id", wid]
        argv += self.worker_args(max_num_seqs, extra, num_kv_blocks)
        return self._spawn(wid, argv, gate)

    def up(self, workers: int, max_num_seqs: int = 2, gate: Gate | None = None) -> Proc:
        argv = ["up", "--workers", str(workers), "--", *self.worker_args(max_num_seqs)]
        return self._spawn(f"up-{uuid.uuid4().hex[:6]}", argv, gate)

    async def ready(self, *procs: Proc) -> None:
        async def beating() -> bool:
            for p in procs:
                if not p.alive():
                    pytest.fail(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
            rows = await self.worker_rows()
            return all(p.name in rows for p in procs)

        await eventually(beating, "the workers' first heartbeats", timeout=READY_TIMEOUT_S)

    async def kvflow(
        self, *args: str, timeout: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None
    ) -> Cli:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "worker.cli",
            *args,
            cwd=REPO,
            env=self.env(**(env or {})),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"kvflow {' '.join(args)} did not finish within {timeout} s")
        assert proc.returncode is not None
        return Cli(tuple(args), proc.returncode, out.decode(), err.decode())

    # the ledger

    async def rows(self, ids: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        stmt = select(requests_table)
        if ids is not None:
            stmt = stmt.where(requests_table.c.id.in_(list(ids)))
        async with self.db.connect() as conn:
            result = (await conn.execute(stmt)).mappings().all()
        return {r["id"]: dict(r) for r in result}

    async def count_rows(self) -> int:
        async with self.db.connect() as conn:
            return int(await conn.scalar(select(func.count()).select_from(requests_table)) or 0)

    async def worker_rows(self) -> dict[str, dict[str, Any]]:
        async with self.db.connect() as conn:
            result = (await conn.execute(select(workers_table))).mappings().all()
        return {r["id"]: dict(r) for r in result}

    async def running_on(self, wid: str) -> list[str]:
        t = requests_table.c
        stmt = select(t.id).where(t.status == "running", t.worker_id == wid)
        async with self.db.connect() as conn:
            return list((await conn.execute(stmt)).scalars().all())

    async def settled(self, ids: Sequence[str], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
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

    async def ready_count(self) -> int:
        declared = await self.channel.declare_queue(self.topo.queue, passive=True)
        return int(declared.declaration_result.message_count or 0)

    async def dead_count(self) -> int:
        declared = await self.channel.declare_queue(self.topo.dead_letter_queue, passive=True)
        return int(declared.declaration_result.message_count or 0)

    async def publish_raw(self, body: bytes, rid: str) -> None:
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=rid,
            correlation_id=rid,
            reply_to=self.reply_queue.name,
        )
        await self.exchange.publish(message, routing_key=self.topo.queue, mandatory=True)

    async def submit_long(
        self, rid: str, max_tokens: int, *, held: bool = False, **kw: Any
    ) -> Handle:
        """A request of exactly `max_tokens` tokens; `held`: a closed gate holds it."""
        prompt = [1, HOLD_TOKEN, 3] if held else [1, 2, 3]
        return await self.client.submit(
            prompt_token_ids=prompt, id=rid, max_tokens=max_tokens, ignore_eos=True, **kw
        )

    async def dead_letters(self, ids: set[str], timeout: float = 20.0) -> dict[str, bytes]:
        """Take messages from `<queue>.dead` until every id in `ids` showed up."""
        queue = await self.channel.get_queue(self.topo.dead_letter_queue, ensure=False)
        found: dict[str, bytes] = {}

        async def drained() -> bool:
            while (m := await queue.get(no_ack=True, fail=False)) is not None:
                assert m.message_id not in found, f"{m.message_id} dead-lettered twice"
                found[str(m.message_id)] = m.body
            return ids <= found.keys()

        await eventually(drained, f"dead letters {sorted(ids - found.keys())}", timeout=timeout)
        return found

    async def heartbeats(self, wid: str, n: int) -> None:
        """Wait until worker `wid` wrote `n` more heartbeats: its event loop, which also
        runs its intake, kept turning for that long."""
        seen: set[Any] = set()

        async def beaten() -> bool:
            seen.add((await self.worker_rows())[wid]["last_heartbeat"])
            return len(seen) > n

        await eventually(beaten, f"{n} heartbeats of {wid}", every=HEARTBEAT_S / 4)
