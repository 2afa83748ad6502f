"""The admin CLI end to end: `kvflow drain | resume | workers | status | scale | up |
cancel | dlq | ledger` as subprocesses, against real RabbitMQ and PostgreSQL and real
worker processes running the tiny random-weight model.

Each test has its own `test.<hex>` queues (KVFLOW_EXCHANGE and KVFLOW_QUEUE point at
them) and its own migrated ledger schema. The control exchange is shared by every
worker on the broker, so the tests address workers by id (or by queue, as `--all`
does), never all of them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

import aio_pika
import msgpack
import pytest
from aio_pika.abc import AbstractIncomingMessage
from sqlalchemy import func, select

from broker.client import Client, Handle, RequestFailed
from broker.messages import CONTENT_TYPE, decode_reply
from broker.topology import Topology
from tests.integration.helpers import eventually, stored
from worker.ledger.migrate import open_engine, upgrade_async
from worker.ledger.tables import requests as requests_table
from worker.ledger.tables import workers as workers_table

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.2
READY_TIMEOUT_S = 90.0
CLI_TIMEOUT_S = 120.0


# -- processes --


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

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by Proc.stop
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *argv],
            cwd=REPO,
            env=self.env(),
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
    ) -> Proc:
        wid = f"{name}-{uuid.uuid4().hex[:6]}"
        argv = ["worker", "--worker-id", wid]
        argv += self.worker_args(max_num_seqs, extra, num_kv_blocks)
        return self._spawn(wid, argv)

    def up(self, workers: int, max_num_seqs: int = 2) -> Proc:
        argv = ["up", "--workers", str(workers), "--", *self.worker_args(max_num_seqs)]
        return self._spawn(f"up-{uuid.uuid4().hex[:6]}", argv)

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

    async def submit_long(self, rid: str, max_tokens: int, **kw: Any) -> Handle:
        return await self.client.submit(
            prompt_token_ids=[1, 2, 3], id=rid, max_tokens=max_tokens, ignore_eos=True, **kw
        )


@pytest.fixture
async def env(
    amqp_url: str,
    rabbit_topology: Topology,
    empty_schema: Callable[[], str],
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
) -> AsyncIterator[Env]:
    url = empty_schema()
    await upgrade_async(url)
    e = Env(amqp_url, rabbit_topology, url, tmp_path, tiny_model_dir("smollm2"))
    try:
        await e.open()
        yield e
    finally:
        await e.close()


async def results(handles: Sequence[Handle], timeout: float) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(h.result(timeout) for h in handles)))


def by_worker(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w["worker"]: w for w in doc["workers"]}


# -- drain and resume --


@pytest.mark.timeout(150)
async def test_drain_finishes_running_work_then_resume_serves_the_rest(env: Env) -> None:
    w = env.worker("drain", max_num_seqs=2)
    await env.ready(w)
    n = 12
    handles = [await env.submit_long(f"d-{i}", 200) for i in range(n)]
    await eventually(lambda: env.running_on(w.name), "requests running on the worker")

    doc = (await env.kvflow("drain", w.name, "--timeout", "30", "--json")).ok().json
    assert [r["worker"] for r in doc["drained"]] == [w.name], doc
    drained = doc["drained"][0]["info"]
    assert drained["state"] == "drained" and drained["requeued"] == 0, drained
    assert drained["running"] == 0 and drained["held"] == 0, drained

    # it finished what it had and pulls nothing new
    finished = {rid for rid, r in (await env.rows()).items() if r["status"] == "completed"}
    assert finished, "the worker finished nothing it held"
    ready = await env.ready_count()
    assert ready == n - len(finished), (ready, finished)
    await asyncio.sleep(2.0)
    assert await env.ready_count() == ready, "a drained worker pulled new messages"
    rows = await env.rows()
    assert {rid for rid, r in rows.items() if r["status"] == "completed"} == finished
    assert not [rid for rid, r in rows.items() if r["status"] == "running"], rows
    assert await env.dead_count() == 0

    async def shown_drained() -> bool:
        doc = (await env.kvflow("workers", "--json")).ok().json
        return by_worker(doc)[w.name]["status"] == "drained"

    await eventually(shown_drained, "`kvflow workers` to show the worker drained", timeout=20)

    resumed = (await env.kvflow("resume", w.name, "--json")).ok().json
    assert [r["info"]["state"] for r in resumed["acks"]] == ["serving"], resumed
    outcomes = await results(handles, timeout=120)
    rows = await env.settled([h.id for h in handles])
    assert await env.count_rows() == n
    for h, result in zip(handles, outcomes, strict=True):
        row = rows[h.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 200, row
        assert row["attempts"] == 1, f"{h.id} ran twice: {row}"
        assert stored(result["text"]) == row["output_text"]
    assert await env.dead_count() == 0
    assert w.alive(), w.tail()


@pytest.mark.timeout(150)
async def test_drain_past_its_timeout_requeues_and_resume_completes(env: Env) -> None:
    w = env.worker("requeue", max_num_seqs=8)
    await env.ready(w)
    n = 24  # three full batches: about 2 s each here
    handles = [await env.submit_long(f"r-{i}", 240) for i in range(n)]

    async def batch_running() -> bool:
        return len(await env.running_on(w.name)) >= 8

    await eventually(batch_running, "a full batch running", every=0.02)
    drain = ("drain", "--all", "--window", "1", "--timeout", "0.5", "--json")
    doc = (await env.kvflow(*drain)).ok().json
    assert doc["targets"] == [w.name], doc  # --all: the workers of this queue only
    info = doc["drained"][0]["info"]
    assert info["state"] == "drained" and info["requeued"] >= 2, info
    assert info["running"] == 0 and info["held"] == 0, info

    async def requeued() -> bool:
        return await env.ready_count() == n - await _completed(env)

    await eventually(requeued, "the unfinished requests back in the queue", timeout=20)
    assert await env.dead_count() == 0, "a drained request was dead-lettered"

    resumed = (await env.kvflow("resume", "--all", "--json")).ok().json
    assert [r["worker"] for r in resumed["acks"]] == [w.name], resumed
    outcomes = await results(handles, timeout=120)
    rows = await env.settled([h.id for h in handles])
    again = [rid for rid, r in rows.items() if r["attempts"] >= 2]
    assert len(again) >= 2, f"nothing was requeued: {rows}"
    for h, result in zip(handles, outcomes, strict=True):
        row = rows[h.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 240, row
        assert stored(result["text"]) == row["output_text"]
    assert await env.dead_count() == 0
    assert await env.ready_count() == 0


async def _completed(env: Env) -> int:
    return sum(r["status"] == "completed" for r in (await env.rows()).values())


# -- scale with a supervisor --


@pytest.mark.timeout(240)
async def test_scale_up_and_down_under_load(env: Env) -> None:
    sup = env.up(workers=1)

    async def live_workers() -> dict[str, dict[str, Any]]:
        doc = (await env.kvflow("workers", "--json")).ok().json
        return {wid: w for wid, w in by_worker(doc).items() if w["alive"]}

    async def one_live() -> bool:
        if not sup.alive():
            pytest.fail(f"kvflow up exited with {sup.proc.returncode}:\n{sup.tail()}")
        return len(await env.worker_rows()) == 1

    await eventually(one_live, "the supervisor's first worker", timeout=READY_TIMEOUT_S)
    n = 48
    handles = [await env.submit_long(f"s-{i}", 160) for i in range(n)]

    up3 = (await env.kvflow("scale", "3", "--json")).ok().json
    assert len(up3["done"]) == 1, up3
    done = up3["done"][0]["info"]
    assert done["from"] == 1 and done["to"] == 3 and len(done["started"]) == 2, done
    assert done["not_ready"] == [], done
    live = await live_workers()
    assert len(live) == 3 and set(done["started"]) <= set(live), live
    assert all(w["status"] == "serving" and w["queue"] == env.topo.queue for w in live.values())
    assert await env.ready_count() > 0, "precondition: the load outlasts the scale-up"

    async def newcomers_serve() -> bool:
        rows = await env.rows()
        return set(done["started"]) <= {r["worker_id"] for r in rows.values()}

    await eventually(newcomers_serve, "the new workers to take requests", timeout=60)

    down = (await env.kvflow("scale", "1", "--json")).ok().json
    info = down["done"][0]["info"]
    assert sorted(info["stopped"]) == sorted(done["started"]), "not the newest stopped first"
    assert info["workers"] == [w for w in live if w not in done["started"]], info
    doc = by_worker((await env.kvflow("workers", "--json")).ok().json)
    assert [w for w, v in doc.items() if v["alive"]] == info["workers"], doc
    for wid in done["started"]:
        assert doc[wid]["status"] == "stopped", doc[wid]

    outcomes = await results(handles, timeout=150)
    rows = await env.settled([h.id for h in handles])
    assert await env.count_rows() == n
    for h, result in zip(handles, outcomes, strict=True):
        row = rows[h.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 160, row
        assert stored(result["text"]) == row["output_text"]
    assert len({r["worker_id"] for r in rows.values()}) == 3, "not every worker served"
    assert await env.dead_count() == 0

    # a worker that dies is replaced
    [last] = info["workers"]
    os.kill(int(doc[last]["pid"]), signal.SIGKILL)

    async def replaced() -> list[str]:
        return [w for w in await live_workers() if w not in (last, *done["started"])]

    await eventually(replaced, "the supervisor to restart the killed worker", timeout=60)

    sup.proc.send_signal(signal.SIGTERM)
    assert await sup.wait(60) == 0, sup.tail()
    rows_after = await env.worker_rows()
    assert rows_after[last]["state"] == "serving", "precondition: killed, not stopped"
    del rows_after[last]
    assert {r["state"] for r in rows_after.values()} == {"stopped"}, rows_after
    assert "Traceback" not in sup.output(), sup.tail()


# -- cancel --


@pytest.mark.timeout(150)
async def test_cancel_a_queued_and_a_running_request(env: Env) -> None:
    # queued: published while nothing consumes
    queued = await env.submit_long("c-queued", 50)
    doc = (await env.kvflow("cancel", "c-queued", "--json")).ok().json
    assert doc["outcome"] == "cancelled" and doc["ledger_written"], doc
    w = env.worker("cancel", max_num_seqs=32, num_kv_blocks=640)
    await env.ready(w)
    with pytest.raises(RequestFailed) as info:
        await queued.result(30)
    assert info.value.code == "cancelled"
    row = (await env.settled(["c-queued"]))["c-queued"]
    assert row["status"] == "cancelled" and row["error_code"] == "cancelled", row
    assert row["first_token_at"] is None and row["output_text"] is None, "it ran"

    # running: a long request in a full batch (about 6 s here)
    others = [await env.submit_long(f"c-other-{i}", 240) for i in range(31)]
    running = await env.submit_long("c-running", 240)

    async def is_running() -> bool:
        return "c-running" in await env.running_on(w.name)

    await eventually(is_running, "the request to run", every=0.02)
    doc = (await env.kvflow("cancel", "c-running", "--json")).ok().json
    assert doc["outcome"] == "cancelled" and doc["running_on"] == w.name, doc
    assert not doc["ledger_written"], doc
    with pytest.raises(RequestFailed) as info:
        await running.result(30)
    assert info.value.code == "cancelled"
    row = (await env.rows(["c-running"]))["c-running"]
    assert row["status"] == "cancelled", row
    assert 0 < row["completion_tokens"] < 240, f"not aborted mid-way: {row}"

    # a finished request cannot be cancelled
    await results(others, timeout=60)
    late = await env.kvflow("cancel", "c-other-0")
    assert late.code == 1 and "already finished: status completed" in late.err, late
    assert (await env.rows(["c-other-0"]))["c-other-0"]["status"] == "completed"
    assert await env.dead_count() == 0


# -- the dead-letter queue --

CAP = 64


@pytest.mark.timeout(150)
async def test_dlq_list_replay_and_purge(env: Env) -> None:
    w = env.worker("dlq", extra=["--max-tokens-cap", str(CAP)])
    await env.ready(w)

    def pack(**fields: Any) -> bytes:
        return msgpack.packb(fields, use_bin_type=True)

    bad = {
        "dlq-garbage": (b"\xc1\xc1 not msgpack", "invalid_request"),
        "dlq-too-long": (pack(prompt_token_ids=[100] * 2000), "prompt_too_long"),
        "dlq-over-cap": (
            pack(prompt_token_ids=[1, 2], max_tokens=CAP + 36, ignore_eos=True),
            "invalid_request",
        ),
    }
    for rid, (body, _) in bad.items():
        await env.publish_raw(body, rid)

    async def all_dead() -> bool:
        return await env.dead_count() == len(bad)

    await eventually(all_dead, "three dead letters", timeout=30)

    for _ in range(2):  # listing leaves them in place
        doc = (await env.kvflow("dlq", "list", "--json")).ok().json
        assert doc["count"] == 3 and doc["shown"] == 3, doc
        listed = {m["id"]: m for m in doc["messages"]}
        assert set(listed) == set(bad), listed
        for rid, (body, code) in bad.items():
            m = listed[rid]
            assert m["reason"] == "rejected" and m["deaths"] == 1, m
            assert m["status"] == "rejected" and m["error_code"] == code and m["error"], m
            assert m["size"] == len(body) and m["age_s"] is not None and m["age_s"] >= 0, m
        assert await env.dead_count() == 3
    limited = (await env.kvflow("dlq", "list", "--limit", "1", "--json")).ok().json
    assert limited["count"] == 3 and limited["shown"] == 1, limited
    assert await env.dead_count() == 3

    # fix the cause (a higher cap), then replay the one it refused
    await w.stop()
    w2 = env.worker("dlq2", extra=["--max-tokens-cap", "256"])
    await env.ready(w2)
    doc = (await env.kvflow("dlq", "replay", "--id", "dlq-over-cap", "--json")).ok().json
    assert doc["not_found"] == [], doc
    [outcome] = doc["replayed"]
    assert outcome["replayed"] and outcome["ledger_reset"], outcome
    assert outcome["status_before"] == "rejected", outcome

    async def answered() -> bool:
        return any(r["type"] == "result" for r in env.replies["dlq-over-cap"])

    await eventually(answered, "the replayed request's result", timeout=30)
    row = (await env.settled(["dlq-over-cap"]))["dlq-over-cap"]
    assert row["status"] == "completed" and row["completion_tokens"] == CAP + 36, row
    assert row["error"] is None and row["worker_id"] == w2.name, row
    assert await env.dead_count() == 2

    missing = await env.kvflow("dlq", "replay", "--id", "no-such-id")
    assert missing.code == 1 and "no-such-id" in missing.err, missing
    assert await env.dead_count() == 2

    # replaying all without a fix: each is refused again and comes back, once
    doc = (await env.kvflow("dlq", "replay", "--all", "--json")).ok().json
    assert sorted(o["id"] for o in doc["replayed"]) == ["dlq-garbage", "dlq-too-long"], doc
    assert all(o["replayed"] and o["ledger_reset"] for o in doc["replayed"]), doc

    async def back() -> bool:
        rows = await env.rows(["dlq-garbage", "dlq-too-long"])
        return await env.dead_count() == 2 and all(r["status"] == "rejected" for r in rows.values())

    await eventually(back, "the replayed bad messages back in the dead-letter queue")
    assert [r["type"] for r in env.replies["dlq-too-long"]] == ["error", "error"]

    purged = (await env.kvflow("dlq", "purge", "--yes", "--json")).ok().json
    assert purged["purged"] == 2, purged
    assert await env.dead_count() == 0
    assert (await env.kvflow("dlq", "list", "--json")).ok().json["count"] == 0
    refused = await env.kvflow("dlq", "purge")
    assert refused.code == 2 and "--yes" in refused.err, refused


# -- status and the ledger commands --


@pytest.mark.timeout(150)
async def test_status_and_ledger_commands_match_what_was_sent(env: Env, tmp_path: Path) -> None:
    w = env.worker("status", max_num_seqs=4)
    await env.ready(w)
    n = 10
    handles = [await env.submit_long(f"st-{i}", 8 + i) for i in range(n)]
    outcomes = await results(handles, timeout=60)
    await env.settled([h.id for h in handles])
    tokens = sum(8 + i for i in range(n))

    async def quiet() -> dict[str, Any] | None:
        doc = (await env.kvflow("status", "--json")).ok().json
        return doc if doc["requests"] == {"ready": 0, "unacked": 0} else None

    doc = await eventually(quiet, "the queue to show 0 ready, 0 unacked", timeout=30, every=1)
    assert doc["queue"] == env.topo.queue and doc["dead_letters"] == 0, doc
    assert doc["errors"] == [], doc
    led = doc["ledger"]
    assert led["completed"] == n and led["failed"] == 0 and led["finished"] == n, led
    assert led["completion_tokens"] == tokens and led["output_tokens_per_s"] > 0, led
    assert led["active"] == {"queued": 0, "running": 0}, led
    for name in ("ttft_s", "e2e_s"):
        p = led["latency_s"][name]
        assert 0 < p["p50"] <= p["p99"], (name, p)
    assert [x["worker"] for x in doc["workers"] if x["alive"]] == [w.name], doc["workers"]

    stats = (await env.kvflow("ledger", "stats", "--since", "10m", "--json")).ok().json
    assert stats["counts"]["completed"] == n and stats["completion_tokens"] == tokens, stats
    e2e = sorted(r["timing"]["e2e_s"] for r in outcomes)
    assert stats["latency_s"]["e2e_s"]["p50"] == pytest.approx(
        (e2e[4] + e2e[5]) / 2, rel=1e-3, abs=1e-3
    ), (stats, e2e)
    future = (await env.kvflow("ledger", "stats", "--since", "2099-01-01", "--json")).ok().json
    assert future["finished"] == 0, future

    shown = (await env.kvflow("ledger", "show", "st-3", "--json")).ok().json
    assert shown["id"] == "st-3" and shown["status"] == "completed", shown
    assert shown["completion_tokens"] == 11 and shown["output_text"] == stored(outcomes[3]["text"])
    assert {c.name for c in requests_table.columns} == set(shown), "not every column"
    human = (await env.kvflow("ledger", "show", "st-3")).ok().out
    assert "output_token_ids" in human and "completed" in human, human
    absent = await env.kvflow("ledger", "show", "nope")
    assert absent.code == 1 and "no ledger row" in absent.err, absent

    jsonl = tmp_path / "out.jsonl"
    (await env.kvflow("ledger", "export", "--since", "1h", "-o", str(jsonl))).ok()
    exported = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert sorted(r["id"] for r in exported) == sorted(h.id for h in handles)
    assert all(r["status"] == "completed" for r in exported)
    csv_out = (await env.kvflow("ledger", "export", "--since", "1h", "--format", "csv")).ok()
    # Parsed as CSV: generated text may hold newlines, which CSV quotes within a field.
    table = list(csv.reader(io.StringIO(csv_out.out)))
    assert table[0][:2] == ["id", "status"], table[0]
    by_id = {row[0]: dict(zip(table[0], row, strict=True)) for row in table[1:]}
    assert sorted(by_id) == sorted(h.id for h in handles)
    assert by_id["st-3"]["output_text"] == stored(outcomes[3]["text"])

    human = (await env.kvflow("status")).ok().out
    assert f"queue {env.topo.queue}: 0 ready, 0 unacked" in human, human
    assert "completed 10" in human, human


# -- unreachable services --


@pytest.mark.timeout(150)
async def test_every_command_fails_cleanly_when_a_service_is_down(env: Env) -> None:
    await env.client.submit("x", id="down-1", wait_reply=False)  # the queues exist
    secret = "s3cret-" + uuid.uuid4().hex[:8]
    no_rabbit = {"KVFLOW_AMQP_URL": f"amqp://guest:{secret}@127.0.0.1:1/"}
    no_db = {"KVFLOW_DATABASE_URL": f"postgresql://postgres:{secret}@127.0.0.1:1/x"}
    broker_commands = [
        ["workers", "--ping", "0.5"],
        ["status"],
        ["drain", "--all"],
        ["drain", "some-worker", "--timeout", "1"],
        ["resume", "--all"],
        ["cancel", "down-2"],
        ["scale", "2"],
        ["up", "--workers", "1"],
        ["dlq", "list"],
        ["dlq", "replay", "--all"],
        ["dlq", "purge", "--yes"],
    ]
    database_commands = [
        ["workers"],
        ["status"],
        ["cancel", "down-1"],
        ["dlq", "list"],
        ["dlq", "replay", "--id", "down-1"],
        ["ledger", "show", "down-1"],
        ["ledger", "stats"],
        ["ledger", "export", "--since", "1h"],
    ]
    runs = [(args, no_rabbit, "cannot reach RabbitMQ at") for args in broker_commands]
    runs += [(args, no_db, "cannot reach the database at") for args in database_commands]
    outcomes = await asyncio.gather(*(env.kvflow(*args, env=bad) for args, bad, _ in runs))
    for (args, _, message), got in zip(runs, outcomes, strict=True):
        text = got.out + got.err
        assert got.code == 1, f"kvflow {' '.join(args)} -> {got.code}\n{text}"
        assert message in got.err and "127.0.0.1:1" in got.err, f"{args}: {text}"
        assert secret not in text, f"{args}: the password leaked: {text}"
        assert "Traceback" not in text, f"{args}: {text}"
    assert await env.ready_count() == 1, "a failed command lost the queued message"
