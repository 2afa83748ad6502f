"""Faults, load and hostile input against the real RabbitMQ and PostgreSQL: the machinery
shared by tests/integration/test_stress.py (CI sizes) and ops/stress/ (the big runs and
the soak).

Each scenario drives a `Harness` (tests/integration/harness.py) and returns a `Tally`:
how many requests were sent and how each one ended, counted from three independent
records: the ledger (one terminal row per id), the replies (read from a durable quorum
reply queue, so that they survive a broker restart) and the dead-letter queue.

Service outages (RabbitMQ restarted, PostgreSQL stopped) hold an exclusive `flock` on
SERVICES_LOCK for as long as the service is down, so that other users of the machine's
services can wait for it instead of running into the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import msgpack
import pytest

from broker.messages import CONTENT_TYPE, decode_reply, encode_request
from tests.integration.harness import HOLD, Harness, HeldSampler, WorkerProc
from tests.integration.rawamqp import HUGE_TIME, PLACEHOLDER_TIME, Patch, RawPublisher

SERVICES_LOCK = Path(os.environ.get("KVFLOW_SERVICES_LOCK", "/tmp/kvflow-services.lock"))
FUZZ_HEADER = "x-stress-seq"  # every published message carries its sequence number


# -- service outages ----------------------------------------------------------------------


@contextlib.contextmanager
def services_lock() -> Iterator[None]:
    """Hold the machine's service lock (exclusive) for the duration of an outage."""
    with open(SERVICES_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.asynccontextmanager
async def locked_services() -> AsyncIterator[None]:
    """`services_lock` without blocking the event loop while it waits."""
    f = open(SERVICES_LOCK, "a")  # noqa: SIM115 - closed below
    try:
        await asyncio.to_thread(fcntl.flock, f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        f.close()


def _run(*cmd: str, timeout: float = 120) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {done.returncode}: {done.stderr.strip()}")


async def _amqp_up(url: str, timeout: float = 120.0) -> None:
    until = time.monotonic() + timeout
    while True:
        try:
            connection = await aio_pika.connect(url, timeout=5)
            await connection.close()
            return
        except Exception:
            if time.monotonic() > until:
                raise
            await asyncio.sleep(0.5)


async def restart_rabbitmq(amqp_url: str) -> None:
    """stop_app then start_app, under the service lock; returns once it takes logins."""
    async with locked_services():
        try:
            await asyncio.to_thread(_run, "rabbitmqctl", "-q", "stop_app")
        finally:
            await asyncio.to_thread(_run, "rabbitmqctl", "-q", "start_app")
            await asyncio.to_thread(_run, "rabbitmqctl", "-q", "await_startup")
            await _amqp_up(amqp_url)


def _pg_cluster() -> str:
    versions = sorted(os.listdir("/etc/postgresql"))
    return versions[-1]


def _pg(action: str) -> None:
    _run(
        "pg_ctlcluster",
        "--skip-systemctl-redirect",
        _pg_cluster(),
        "main",
        action,
        *(["-m", "fast"] if action == "stop" else []),
    )


async def _pg_up(timeout: float = 120.0) -> None:
    import asyncpg

    until = time.monotonic() + timeout
    while True:
        try:
            conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres", timeout=5)
            await conn.close()
            return
        except Exception:
            if time.monotonic() > until:
                raise
            await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def postgres_down() -> AsyncIterator[None]:
    """PostgreSQL stopped (fast: open connections cut) for the body; always started again."""
    async with locked_services():
        try:
            await asyncio.to_thread(_pg, "stop")
            yield
        finally:
            await asyncio.to_thread(_pg, "start")
            await _pg_up()


# -- observing workers --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the worker and its engine process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [
                    int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()
                ]
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def scrape(port: int) -> dict[str, float]:
    """A worker's /metrics, each series summed over its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    sums: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)", line)
            if m:
                sums[m.group(1)] += float(m.group(3))
    return dict(sums)


class MemorySampler:
    """RSS of each worker's process tree, sampled every `every` seconds, with the number
    of requests settled so far (to tell warm-up from steady state)."""

    def __init__(self, workers: Sequence[WorkerProc], every: float = 0.5) -> None:
        self.workers = list(workers)
        self.every = every
        self.samples: list[tuple[int, dict[str, int]]] = []  # (settled, worker -> bytes)
        self.settled = 0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        rss = {w.id: rss_bytes(w.proc.pid) for w in self.workers if w.alive()}
        self.samples.append((self.settled, rss))

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every)

    async def __aenter__(self) -> MemorySampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sample()

    def growth(self, warm_from: int, last_from: int | None = None) -> dict[str, float]:
        """Per worker: the largest RSS seen once `last_from` requests were settled (default
        `warm_from`), over the first RSS seen once `warm_from` were (1.0 = no growth)."""
        last_from = warm_from if last_from is None else last_from
        out: dict[str, float] = {}
        for w in self.workers:
            warm = [s[w.id] for n, s in self.samples if n >= warm_from and w.id in s]
            late = [s[w.id] for n, s in self.samples if n >= last_from and w.id in s]
            if warm and late:
                out[w.id] = max(late) / warm[0]
        return out


# -- traffic and its accounting -----------------------------------------------------------


@dataclasses.dataclass
class Sent:
    """One published message: `tag` is its correlation_id (None when the case sends none),
    `rid` the id the ledger should key it on (None if it has no usable one), `expect`
    what must become of it: "complete", "reject" or "either"."""

    seq: int
    kind: str
    rid: str | None
    tag: str | None
    expect: str
    replies: bool  # a reply can reach our reply queue


@dataclasses.dataclass
class Tally:
    """How every message of a scenario ended (the README's table rows)."""

    name: str
    requests: int = 0
    completed: int = 0
    rejected: int = 0  # an error reply or a dead-letter entry, as expected
    lost: int = 0  # no terminal ledger row / no trace at all
    duplicated: int = 0  # more than one ledger row, or final replies that differ
    # A second final reply equal to the first: resent from the ledger when the ack of a
    # confirmed reply was lost to a broker restart (replies are at-least-once; one run,
    # one row). Counted and reported, not a failure.
    repeated: int = 0
    unanswered: int = 0  # a reply was possible and none came
    dead_lettered: int = 0  # of messages that should have completed
    wrong: list[str] = dataclasses.field(default_factory=list)  # the first few failures
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def bad(self, what: str) -> None:
        if len(self.wrong) < 20:
            self.wrong.append(what)

    @property
    def clean(self) -> bool:
        return not (
            self.lost or self.duplicated or self.unanswered or self.dead_lettered or self.wrong
        )

    def summary(self) -> str:
        return (
            f"{self.name}: {self.requests} messages, {self.completed} completed, "
            f"{self.rejected} rejected; lost {self.lost}, duplicated {self.duplicated}, "
            f"repeated replies {self.repeated}, "
            f"unanswered {self.unanswered}, dead-lettered {self.dead_lettered}; "
            f"{self.seconds:.0f} s; {self.notes}"
            + (f"; failures: {self.wrong}" if self.wrong else "")
        )


class ReplyBox:
    """A durable quorum queue the scenario's requests reply to: replies survive a broker
    restart and are read after the run, by correlation_id."""

    def __init__(self, amqp_url: str, name: str) -> None:
        self.amqp_url = amqp_url
        self.name = name
        self.replies: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.unreadable = 0

    async def declare(self) -> None:
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        try:
            channel = await connection.channel()
            await channel.declare_queue(
                self.name, durable=True, arguments={"x-queue-type": "quorum"}
            )
        finally:
            await connection.close()

    async def read(self) -> None:
        """Take every reply now in the queue."""
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(self.name, ensure=False)
            while (m := await queue.get(no_ack=True, fail=False, timeout=30)) is not None:
                try:
                    reply = decode_reply(m.body)
                except ValueError:
                    self.unreadable += 1
                    continue
                self.replies[str(m.correlation_id or reply.get("id"))].append(reply)
        finally:
            await connection.close()

    def finals(self, tag: str) -> list[dict[str, Any]]:
        return [r for r in self.replies.get(tag, []) if r["type"] in ("result", "error")]

    async def delete(self) -> None:
        with contextlib.suppress(Exception):
            connection = await aio_pika.connect(self.amqp_url, timeout=10)
            try:
                channel = await connection.channel()
                await channel.queue_delete(self.name)
            finally:
                await connection.close()


class Traffic:
    """Publishes a scenario's messages (its own connection, so a test can reconnect it)
    and accounts for them afterwards."""

    def __init__(self, h: Harness, name: str) -> None:
        self.h = h
        self.box = ReplyBox(h.amqp_url, f"{h.topo.queue}.replies")
        self.sent: list[Sent] = []
        self.tally = Tally(name)
        self._started = time.monotonic()
        self._connection: Any = None
        self._exchange: Any = None

    async def __aenter__(self) -> Traffic:
        await self.box.declare()
        await self._connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()
        await self.box.delete()

    async def _connect(self) -> None:
        self._connection = await aio_pika.connect(self.h.amqp_url, timeout=10)
        channel = await self._connection.channel()
        self._exchange = await channel.get_exchange(self.h.topo.exchange, ensure=False)

    async def disconnect(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None

    async def publish(
        self,
        body: bytes,
        *,
        kind: str,
        rid: str | None,
        expect: str,
        reply: bool = True,
        reply_to: str | None = None,
        tag: str | bool | None = True,
        content_type: str | None = CONTENT_TYPE,
        headers: dict[str, Any] | None = None,
        **props: Any,
    ) -> Sent:
        """Publish one message; the reply goes to the box unless `reply` is False (no
        reply_to) or `reply_to` names another queue."""
        seq = len(self.sent)
        corr = f"c{seq}-{uuid.uuid4().hex[:6]}" if tag is True else (tag or None)
        to = reply_to if reply_to is not None else (self.box.name if reply else None)
        sent = Sent(seq, kind, rid, corr, expect, replies=to == self.box.name and corr is not None)
        self.sent.append(sent)
        if self._connection is None:
            await self._connect()
        message = aio_pika.Message(
            body,
            content_type=content_type,
            delivery_mode=props.pop("delivery_mode", aio_pika.DeliveryMode.PERSISTENT),
            message_id=props.pop("message_id", rid),
            correlation_id=corr,
            reply_to=to,
            headers={FUZZ_HEADER: seq, **(headers or {})},
            **props,
        )
        await self._exchange.publish(message, routing_key=self.h.topo.queue, mandatory=True)
        return sent

    async def request(
        self, rid: str, prompt_token_ids: list[int], max_tokens: int, **fields: Any
    ) -> Sent:
        """A valid request of exactly `max_tokens` tokens (ignore_eos), greedy by default."""
        body = encode_request(
            id=rid,
            prompt_token_ids=prompt_token_ids,
            sampling={"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **fields},
        )
        return await self.publish(body, kind="valid", rid=rid, expect="complete")

    # accounting

    async def dead_letters(self) -> dict[int, str]:
        """Every message now in the dead-letter queue, by sequence number: why and from
        which queue the broker dead-lettered it (its `x-death`), for the failure's text."""
        found: dict[int, str] = {}
        connection = await aio_pika.connect(self.h.amqp_url, timeout=10)
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(self.h.topo.dead_letter_queue, ensure=False)
            while (m := await queue.get(no_ack=True, fail=False, timeout=30)) is not None:
                seq = (m.headers or {}).get(FUZZ_HEADER)
                if isinstance(seq, int):
                    if seq in found:
                        self.tally.duplicated += 1
                        self.tally.bad(f"message {seq} dead-lettered twice")
                    found[seq] = _death(m.headers or {})
                else:
                    self.tally.bad(f"an unknown dead letter {m.message_id!r}")
        finally:
            await connection.close()
        return found

    async def settle(self, timeout: float) -> Tally:
        """Wait (bounded) until every message has its outcome, then count them."""
        t = self.tally
        must_row = sorted({s.rid for s in self.sent if s.expect == "complete" and s.rid})
        with contextlib.suppress(Exception, pytest.fail.Exception):  # counted below
            await self.h.settled(must_row, timeout=timeout)
        until = time.monotonic() + timeout
        dead: dict[int, str] = {}
        while True:
            await self.box.read()
            dead |= await self.dead_letters()
            missing = [
                s
                for s in self.sent
                if (s.replies and not self.box.finals(str(s.tag)))
                or (s.expect == "reject" and not s.replies and s.seq not in dead)
            ]
            if not missing or time.monotonic() > until:
                break
            await asyncio.sleep(0.5)
        rows = await self.h.rows()
        self._count(rows, dead)
        t.seconds = time.monotonic() - self._started
        return t

    def _count(self, rows: dict[str, dict[str, Any]], dead: dict[int, str]) -> None:
        t = self.tally
        t.requests = len(self.sent)
        per_id = Counter(s.rid for s in self.sent if s.rid)
        for s in self.sent:
            finals = self.box.finals(str(s.tag)) if s.replies else []
            row = rows.get(s.rid) if s.rid else None
            if len(finals) > 1:
                if all(_same_final(f, finals[0]) for f in finals[1:]):
                    t.repeated += 1
                else:
                    t.duplicated += 1
                    t.bad(f"{s.kind} {s.rid}: {len(finals)} final replies that differ")
            outcome = finals[0]["type"] if finals else None
            if s.expect == "complete":
                if s.seq in dead:
                    t.dead_lettered += 1
                    t.bad(f"{s.kind} {s.rid}: dead-lettered ({dead[s.seq]})")
                if row is None or row["status"] != "completed":
                    t.lost += 1
                    t.bad(f"{s.kind} {s.rid}: ledger row {row and row['status']}")
                    continue
                if s.replies and outcome is None:
                    t.unanswered += 1
                    t.bad(f"{s.kind} {s.rid}: no reply")
                    continue
                if outcome == "error":
                    t.bad(f"{s.kind} {s.rid}: error reply {finals[0].get('error')}")
                    continue
                if finals and per_id[s.rid] == 1:
                    text = finals[0]["text"].replace("\x00", "\ufffd")
                    if text != row["output_text"]:
                        t.bad(f"{s.kind} {s.rid}: the reply disagrees with the ledger")
                t.completed += 1
            elif s.expect == "reject":
                if s.replies and outcome is None:
                    t.unanswered += 1
                    t.bad(f"{s.kind} #{s.seq}: no reply")
                elif outcome == "result":
                    t.bad(f"{s.kind} #{s.seq}: a result for a bad message")
                elif s.seq not in dead and outcome is None:
                    t.lost += 1
                    t.bad(f"{s.kind} #{s.seq}: neither a reply nor a dead letter")
                else:
                    t.rejected += 1
            else:  # either: served, or refused with a trace
                if outcome == "result" or (
                    row is not None and row["status"] == "completed" and s.seq not in dead
                ):
                    t.completed += 1
                elif outcome == "error" or s.seq in dead:
                    t.rejected += 1
                elif s.replies:
                    t.unanswered += 1
                    t.bad(f"{s.kind} #{s.seq}: no reply, no dead letter")
                else:
                    t.lost += 1
                    t.bad(f"{s.kind} #{s.seq}: no trace")
        ids = {s.rid for s in self.sent if s.rid}
        stuck = [rid for rid in ids if rid in rows and rows[rid]["status"] in ("queued", "running")]
        if stuck:
            t.lost += len(stuck)
            t.bad(f"ledger rows still open: {stuck[:5]}")
        if self.box.unreadable:
            t.bad(f"{self.box.unreadable} unreadable replies")


# -- scenarios ----------------------------------------------------------------------------


def metrics_args(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]


async def wait_for(what: str, check: Any, timeout: float, every: float = 0.1) -> Any:
    """Poll `check()` until truthy; raises TimeoutError naming `what`."""
    until = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > until:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)


async def _statuses(h: Harness, ids: Sequence[str]) -> Counter[str]:
    return Counter(r["status"] for r in (await h.rows(ids)).values())


async def rabbitmq_restart(
    h: Harness, model: Path, n: int = 60, max_tokens: int = 48, extra: Sequence[str] = ()
) -> Tally:
    """Two workers serve `n` requests; RabbitMQ is restarted while some are done and some
    are running, then `n // 3` more are published. Every 15th request is held behind the
    harness's gate until the broker is back, so that requests are in flight when it stops
    however fast the workers run. Returns the tally, with each worker's metrics and log
    evidence in notes."""
    ports = [free_port(), free_port()]
    ws = [
        h.start(f"rmq-{i}", model=model, max_num_seqs=4, extra=[*metrics_args(p), *extra])
        for i, p in enumerate(ports)
    ]
    await h.ready(*ws)
    h.hold()
    async with Traffic(h, "RabbitMQ restarted mid-run") as tr:
        ids = [f"rmq-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
        held = ids[::15]
        for i, rid in enumerate(ids):
            await tr.request(rid, [HOLD if rid in held else 1, 2, 3 + i % 50], max_tokens)

        async def midway() -> bool:
            c = await _statuses(h, ids)
            return c["completed"] >= 4 and (await _statuses(h, held))["running"] >= 2

        await wait_for("some requests done and held ones running", midway, 120, every=0.02)
        await tr.disconnect()
        before = [scrape(p) for p in ports]
        try:
            await restart_rabbitmq(h.amqp_url)
        finally:
            h.release()
        for i in range(n // 3):  # and requests published after the restart are served too
            await tr.request(f"rmq-after-{i}-{uuid.uuid4().hex[:6]}", [1, 2, 3 + i], max_tokens)
        tally = await tr.settle(timeout=120)
    after = [scrape(p) for p in ports]
    tally.notes["redelivered"] = sum(
        a.get("kvflow_messages_redelivered_total", 0)
        - b.get("kvflow_messages_redelivered_total", 0)
        for a, b in zip(after, before, strict=True)
    )
    tally.notes["workers alive"] = sum(w.alive() for w in ws)
    tally.notes["logs"] = [
        "Connection to" in w.output() and "Reconnecting" in w.output() for w in ws
    ]
    return tally


async def postgres_outage(h: Harness, model: Path, n: int = 60, max_tokens: int = 32) -> Tally:
    """Two workers serve `n` requests; PostgreSQL is stopped once some are done, and started
    again once both workers' metrics count failed ledger writes. Every 15th request is held
    behind the harness's gate until the server is down, so that some finish during the
    outage however fast the workers run."""
    ports = [free_port(), free_port()]
    ws = [
        h.start(f"pg-{i}", model=model, max_num_seqs=4, extra=metrics_args(p))
        for i, p in enumerate(ports)
    ]
    await h.ready(*ws)
    h.hold()
    async with Traffic(h, "PostgreSQL down mid-run") as tr:
        ids = [f"pg-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
        held = ids[::15]
        for i, rid in enumerate(ids):
            await tr.request(rid, [HOLD if rid in held else 1, 2, 3 + i % 50], max_tokens)

        async def midway() -> bool:
            c = await _statuses(h, ids)
            return c["completed"] >= 4 and (await _statuses(h, held))["running"] >= 2

        await wait_for("some requests done and held ones running", midway, 120, every=0.02)
        async with postgres_down():
            h.release()  # the held requests finish while the ledger is away

            async def both_noticed() -> bool:
                m = [await asyncio.to_thread(scrape, p) for p in ports]
                return all(x.get("kvflow_ledger_write_errors_total", 0) > 0 for x in m)

            await wait_for(
                "both workers to count failed ledger writes", both_noticed, 120, every=0.2
            )
            during = [await asyncio.to_thread(scrape, p) for p in ports]
        await h.db.dispose()  # the harness's pooled connections died with the server
        tally = await tr.settle(timeout=240)
    tally.notes["write errors"] = [m.get("kvflow_ledger_write_errors_total", 0) for m in during]
    tally.notes["pending during"] = [m.get("kvflow_ledger_pending_writes", 0) for m in during]
    tally.notes["workers alive"] = sum(w.alive() for w in ws)
    tally.notes["logs"] = [
        "unavailable" in w.output() and "is back after" in w.output() for w in ws
    ]
    return tally


async def kill_twice(h: Harness, model: Path, n: int = 40, max_tokens: int = 40) -> Tally:
    """Worker B serves throughout; worker A is killed (SIGKILL) while it runs requests, a
    new A likewise, and B finishes everything. Each A holds its requests behind a gate
    (B's never closes) so that they are running when it is killed; each round publishes
    half the requests once both workers are up."""
    gate = h.log_dir / f"gate-a-{uuid.uuid4().hex[:6]}"
    gate.touch()
    hooks_a = {"KVFLOW_TEST_HOOKS": f'{{"hold_token": {HOLD}, "gate": "{gate}"}}'}
    hooks_b = {"KVFLOW_TEST_HOOKS": f'{{"hold_token": {HOLD}, "gate": "{gate}.never"}}'}
    port = free_port()
    b = h.start("kill-b", model=model, max_num_seqs=4, env=hooks_b, extra=metrics_args(port))
    killed: list[list[str]] = []
    ids = [f"kill-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    async with Traffic(h, "kill -9 of a worker, twice in a row") as tr:
        for round_ in range(2):
            a = h.start(f"kill-a{round_}", model=model, max_num_seqs=4, env=hooks_a)
            await h.ready(a, b)
            wave = ids[round_ * n // 2 : (round_ + 1) * n // 2]
            for i, rid in enumerate(wave):
                await tr.request(rid, [HOLD, 2, 3 + i % 50], max_tokens)

            async def a_running(a: WorkerProc = a) -> list[str]:
                rows = await h.rows(ids)
                return [
                    rid
                    for rid, r in rows.items()
                    if r["status"] == "running" and r["worker_id"] == a.id
                ]

            running = await wait_for(f"requests running on {a.id}", a_running, 120, every=0.02)
            a.proc.send_signal(signal.SIGKILL)
            await a.wait(30)
            killed.append(running)
        gate.unlink()
        tally = await tr.settle(timeout=240)
    rows = await h.rows(ids)
    tally.notes["killed while running"] = [len(k) for k in killed]
    tally.notes["served by B"] = sum(r["worker_id"] == b.id for r in rows.values())
    tally.notes["B alive"] = b.alive()
    # the outage shows in B's metrics: A's requests reached it redelivered
    tally.notes["redelivered to B"] = scrape(port).get("kvflow_messages_redelivered_total", 0)
    return tally


async def load(
    h: Harness,
    model: Path,
    n: int,
    max_num_seqs: int = 8,
    max_tokens: int = 4,
    seed: int = 1,
) -> tuple[Tally, HeldSampler, MemorySampler]:
    """`n` short requests (random prompts) to two workers, published as fast as the broker
    confirms them; samples what each worker holds and its resident memory."""
    rng = random.Random(seed)
    ws = [h.start(f"load-{i}", model=model, max_num_seqs=max_num_seqs) for i in range(2)]
    await h.ready(*ws)
    async with (
        Traffic(h, "Load: short requests, two workers") as tr,
        HeldSampler(h, every=0.05) as held,
        MemorySampler(ws) as mem,
    ):
        ids = [f"load-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
        for rid in ids:
            prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(1, 24))]
            await tr.request(rid, prompt, rng.randint(1, max_tokens))

        async def progress() -> bool:
            mem.settled = (await _statuses(h, ids))["completed"]
            return mem.settled == n

        with contextlib.suppress(TimeoutError):
            await wait_for(f"{n} completed rows", progress, timeout=60 + n * 0.5, every=0.5)
        tally = await tr.settle(timeout=120)
    tally.notes["max running rows"] = dict(held.max_running)
    tally.notes["max heartbeat held"] = dict(held.max_held)
    tally.notes["workers alive"] = sum(w.alive() for w in ws)
    return tally, held, mem


async def kv_pressure(
    h: Harness,
    model: Path,
    n: int,
    expected: dict[str, list[int]],
    blocks: int,
    max_num_seqs: int = 8,
) -> tuple[Tally, MemorySampler, dict[str, float]]:
    """`n` long greedy requests through a worker with `blocks` KV blocks; each output
    must equal `expected` (the same request run unconstrained). Both in float32
    (KV_PRESSURE_DTYPE)."""
    port = free_port()
    w = h.start(
        "kv",
        model=model,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=blocks,
        extra=[*metrics_args(port), "--dtype", KV_PRESSURE_DTYPE],
    )
    await h.ready(w)
    async with (
        Traffic(h, f"KV pressure: {blocks} blocks, long outputs") as tr,
        MemorySampler([w]) as mem,
    ):
        for rid, (prompt, max_tokens) in _kv_requests(n).items():
            await tr.request(rid, prompt, max_tokens)

        async def progress() -> bool:
            mem.settled = (await _statuses(h, list(expected)))["completed"]
            return mem.settled == n

        with contextlib.suppress(TimeoutError):
            await wait_for(f"{n} completed rows", progress, timeout=60 + n * 2.0, every=0.5)
        tally = await tr.settle(timeout=120)
    rows = await h.rows(list(expected))
    for rid, tokens in expected.items():
        got = rows.get(rid, {}).get("output_token_ids")
        if got != tokens:
            tally.bad(f"{rid}: output differs from the unconstrained run")
    metrics = scrape(port)
    tally.notes["preemptions"] = metrics.get("kvflow_num_preemptions_total", 0)
    tally.notes["kv usage at end"] = metrics.get("kvflow_kv_cache_usage_perc", -1)
    return tally, mem, metrics


def _kv_requests(n: int, seed: int = 7) -> dict[str, tuple[list[int], int]]:
    """id -> (prompt, max_tokens): prompts of 8-40 tokens, outputs of 64-160 tokens."""
    rng = random.Random(seed)
    return {
        f"kv-{i}": (
            [rng.randrange(3, 40000) for _ in range(rng.randint(8, 40))],
            rng.randint(64, 160),
        )
        for i in range(n)
    }


# Preempted requests are recomputed from their tokens: a prefill recomputes the K/V that
# decode steps wrote, through other kernels. In float32 the results are the same tokens;
# with bfloat16 linear layers and a bfloat16 cache, rounding can tip a near-tie (seen:
# 2 of 200 outputs differed), so the bookkeeping is checked in float32.
KV_PRESSURE_DTYPE = "float32"


def reference_outputs(model: Path, n: int) -> dict[str, list[int]]:
    """The KV-pressure requests run in-process with a KV cache big enough for all."""
    from worker.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.request import SamplingParams

    reqs = _kv_requests(n)
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            num_kv_blocks=4096,
            max_num_seqs=64,
            num_threads=1,
            dtype=KV_PRESSURE_DTYPE,
        )
    )
    outs = engine.generate(
        [p for p, _ in reqs.values()],
        [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for _, m in reqs.values()],
    )
    return {rid: list(o.token_ids) for rid, o in zip(reqs, outs, strict=True)}


def tiny_model(out: Path) -> Path:
    """The integration tests' tiny random-weight SmolLM2-shaped model (the `tiny_dir`
    fixture's, same seed), saved to `out`: for scripts that run outside pytest."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import _configs
    from worker.model.gguf import cached_conversion, default_model_path

    if (out / "config.json").exists():
        return out
    torch.manual_seed(1000 + sorted(_configs()).index("smollm2"))
    model = AutoModelForCausalLM.from_config(_configs()["smollm2"](), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    default = cached_conversion(default_model_path())
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default / f).exists():
            shutil.copy(default / f, out / f)
    return out


# -- fuzz ---------------------------------------------------------------------------------

_FIELDS = (
    "prompt",
    "prompt_token_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "priority",
    "stop",
    "stop_token_ids",
    "metadata",
    "stream",
    "messages",
    "logprobs",
    "deadline",
    "client",
    "ignore_eos",
    "n",
)


def _junk(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(10 if depth < 3 else 6)
    if pick == 0:
        return rng.randrange(-(2**63), 2**63)
    if pick == 1:
        return rng.random() * 10 ** rng.randint(-5, 30) * rng.choice((1, -1))
    if pick == 2:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randint(0, 20)))
    if pick == 3:
        return rng.randbytes(rng.randint(0, 16))
    if pick == 4:
        return rng.choice((None, True, False, float("nan"), float("inf"), 0, -1, ""))
    if pick == 5:
        return 2 ** rng.choice((31, 32, 63)) + rng.choice((-1, 0))
    if pick in (6, 7):
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {str(_junk(rng, 3)): _junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def fuzz_case(rng: random.Random, i: int, tag: str) -> tuple[str, dict[str, Any]]:
    """(kind, publish arguments) for fuzz message `i`: a valid request one time in five,
    otherwise a hostile one. Deterministic given the generator's state."""
    rid = f"fz-{tag}-{i}"
    valid = {
        "id": rid,
        "prompt_token_ids": [rng.randrange(3, 40000) for _ in range(4)],
        "max_tokens": rng.randint(1, 3),
        "ignore_eos": True,
    }
    pack = msgpack.packb
    roll = rng.randrange(100)
    if roll < 20:
        return "valid", {"body": pack(valid), "rid": rid, "expect": "complete"}
    if roll < 30:
        return "random bytes", {
            "body": rng.randbytes(rng.randint(0, 300)),
            "rid": rid,
            "expect": "reject",
        }
    if roll < 40:
        body = pack(valid)
        return "truncated msgpack", {
            "body": body[: rng.randrange(0, len(body))],
            "rid": rid,
            "expect": "reject",
        }
    if roll < 50:
        body = bytearray(pack(valid))
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        # A flipped byte may leave a valid request (or change its id): served or refused.
        return "mutated msgpack", {"body": bytes(body), "rid": rid, "expect": "either"}
    if roll < 62:
        field = rng.choice(_FIELDS)
        return f"wrong type: {field}", {
            "body": pack({**valid, field: _junk(rng)}),
            "rid": rid,
            "expect": "either",
        }
    if roll < 66:
        extra = rng.choice(("prompt", "stop", "client", "id"))
        value = "x" * rng.choice((300, 70_000, 1_100_000))
        data = {**valid, extra: value} if extra != "id" else {**valid, "id": value}
        return f"huge string: {extra}", {"body": pack(data), "rid": rid, "expect": "reject"}
    if roll < 70:
        extra = rng.choice(("prompt_token_ids", "stop_token_ids", "stop", "messages"))
        size = rng.choice((5_000, 100_000))
        value: Any = (
            [7] * size
            if extra.endswith("ids")
            else (["s"] * size if extra == "stop" else [{"role": "user", "content": "x"}] * size)
        )
        return f"huge list: {extra}", {
            "body": pack({**valid, extra: value}),
            "rid": rid,
            "expect": "reject",
        }
    if roll < 73:
        depth = rng.choice((40, 1000, 100_000))
        field = rng.choice(("metadata", "prompt", "stop"))
        value = {"k": _nested(depth)} if field == "metadata" else _nested(depth)
        try:
            body = pack({**valid, field: value})
        except (ValueError, RecursionError):  # msgpack's own depth limit
            body = b"\x91" * depth + b"\x01"
        return f"deep nesting: {field}", {"body": body, "rid": rid, "expect": "reject"}
    if roll < 77:
        ctype = rng.choice(
            ("text/plain", "application/json", "application/x-msgpack; x=1", "", "\u00e9/\u00e9")
        )
        body = pack(valid) if rng.random() < 0.7 else b'{"prompt": "hi"}'
        return f"content type {ctype!r}", {
            "body": body,
            "rid": rid,
            "expect": "either",
            "content_type": ctype or None,
        }
    if roll < 80:
        return "no reply_to (invalid)", {
            "body": pack({**valid, "max_tokens": "x"}),
            "rid": rid,
            "expect": "reject",
            "reply": False,
        }
    if roll < 82:
        return "no reply_to (valid)", {
            "body": pack(valid),
            "rid": rid,
            "expect": "complete",
            "reply": False,
        }
    if roll < 85:
        good = rng.random() < 0.5
        body = pack(valid) if good else pack({**valid, "temperature": -3})
        return "vanished reply queue", {
            "body": body,
            "rid": rid,
            "expect": "complete" if good else "reject",
            "reply_to": f"amq.gen-gone-{rng.randrange(10**9)}",
        }
    if roll < 88:
        props = rng.choice(
            (
                {"priority": 255},
                {"expiration": 60_000},
                {"type": "x" * 255},
                {"app_id": "\u00ff" * 100},
                {"user_id": None},
                {"delivery_mode": 1},
                {"headers": {"x-enqueued-at": "yesterday", "x-delivery-count": -5}},
                {"headers": {"x-kvflow-crashes": "many", "x-enqueued-at": 1e30}},
            )
        )
        return f"properties {sorted(props)}", {
            "body": pack(valid),
            "rid": rid,
            "expect": "complete",
            **props,
        }
    if roll < 91:
        # no id anywhere but the body / nowhere at all
        data = {k: v for k, v in valid.items() if k != "id"}
        if rng.random() < 0.5:
            return "id in the body only", {
                "body": pack(valid),
                "rid": rid,
                "expect": "complete",
                "message_id": None,
            }
        # raw frames: aio-pika would give the message an id of its own
        return "no id at all", {"raw": "no id", "body": pack(data), "rid": None, "expect": "reject"}
    if roll < 94:
        return "raw: non-UTF-8 properties", {
            "raw": True,
            "body": pack(valid),
            "rid": rid,
            "expect": "either",
        }
    return "duplicate id, other body", {
        "dup": True,
        "body": pack(valid),
        "rid": rid,
        "expect": "complete",
    }


async def fuzz(h: Harness, model: Path, n: int, seed: int) -> Tally:
    """`n` fuzz messages (seeded) to one worker, then a valid request that must complete."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    w = h.start("fuzz", model=model, max_num_seqs=8)
    await h.ready(w)
    raw = await RawPublisher.connect(h.amqp_url)
    kinds: Counter[str] = Counter()
    try:
        async with Traffic(h, f"Fuzz (seed {seed})") as tr:
            for i in range(n):
                kind, args = fuzz_case(rng, i, tag)
                kinds[kind.split(":")[0].split(" [")[0]] += 1
                if args.get("raw"):
                    await _publish_raw(tr, raw, h, kind, args)
                    continue
                if args.pop("dup", False):
                    # two valid bodies under one id, each its own reply (correlation_id)
                    await tr.publish(args["body"], kind=kind, rid=args["rid"], expect="complete")
                    other = msgpack.unpackb(args["body"])
                    other["prompt_token_ids"] = [*other["prompt_token_ids"], 9]
                    await tr.publish(
                        msgpack.packb(other), kind=kind, rid=args["rid"], expect="complete"
                    )
                    continue
                body = args.pop("body")
                await tr.publish(body, kind=kind, **args)
            last = await tr.request(f"fz-{tag}-last", [1, 2, 3], 2)
            tally = await tr.settle(timeout=120 + n * 0.05)
            tally.notes["alive"] = w.alive()
            if not w.alive():
                tally.bad(f"the worker exited: {w.tail()}")
            if not tr.box.finals(str(last.tag)):
                tally.bad("the last valid request got no reply")
    finally:
        await raw.close()
    tally.notes["kinds"] = dict(sorted(kinds.items()))
    return tally


async def _publish_raw(
    tr: Traffic, raw: RawPublisher, h: Harness, kind: str, args: dict[str, Any]
) -> None:
    """A message whose message_id or correlation_id is not UTF-8, or whose timestamp is past
    the year 9999 (tests/integration/rawamqp.py)."""
    seq = len(tr.sent)
    rid = args["rid"]
    which = -1 if args["raw"] == "no id" else seq % 3
    props: dict[str, Any] = {
        "content_type": CONTENT_TYPE,
        "delivery_mode": 2,
        "headers": {FUZZ_HEADER: seq},
        "reply_to": tr.box.name,
    }
    patches: tuple[Patch, ...] = ()
    tag: str | None = None
    if which == -1:  # no message_id, correlation_id or body id: a dead letter, no reply
        pass
    elif which == 0:  # message_id not UTF-8: the body's id stands
        props |= {"message_id": "MIDxx", "correlation_id": f"c{seq}"}
        patches = (Patch(b"MIDxx", b"\xff\xfe\xfd\xfc\xfb"),)
        tag = f"c{seq}"
    elif which == 1:  # correlation_id not UTF-8: the reply is keyed by the body's id
        props |= {"message_id": rid, "correlation_id": "CIDxx"}
        patches = (Patch(b"CIDxx", b"\xc3\x28\xa0\xa1\xff"),)
        tag = rid
    else:  # a timestamp past the year 9999
        props |= {"message_id": rid, "correlation_id": f"c{seq}", "timestamp": PLACEHOLDER_TIME}
        patches = (Patch(PLACEHOLDER_TIME.timestamp().__int__().to_bytes(8, "big"), HUGE_TIME),)
        tag = f"c{seq}"
    tr.sent.append(Sent(seq, kind, rid, tag, args["expect"], replies=tag is not None))
    await raw.publish(h.topo.exchange, h.topo.queue, args["body"], props, patches)


# -- soak ---------------------------------------------------------------------------------


async def soak(h: Harness, model: Path, minutes: float, seed: int = 1) -> Tally:
    """Mixed traffic (valid requests, one message in four hostile) to two workers for
    `minutes`, with a fault injected every `fault_every_s` in turn: RabbitMQ restarted,
    PostgreSQL stopped (until both workers count failed writes), worker B killed with
    SIGKILL and started again. Worker A is never killed: its resident memory is the
    figure reported. Then every message is accounted for."""
    rng = random.Random(seed)
    fault_every_s = 60.0
    ports = [free_port(), free_port()]
    a = h.start("soak-a", model=model, max_num_seqs=8, extra=metrics_args(ports[0]))
    b = h.start("soak-b", model=model, max_num_seqs=8, extra=metrics_args(ports[1]))
    await h.ready(a, b)
    tag = uuid.uuid4().hex[:6]
    faults: Counter[str] = Counter()
    unconfirmed = 0
    rss: list[int] = []
    async with Traffic(h, f"Soak, {minutes:g} min") as tr:
        start = time.monotonic()
        next_fault = start + fault_every_s
        turn = 0
        i = 0
        while time.monotonic() - start < minutes * 60:
            try:
                counts = await _statuses_all(h)
            except Exception:  # the ledger was just restarted: a stale pooled connection
                await h.db.dispose()
                await asyncio.sleep(0.5)
                continue
            open_rows = counts["queued"] + counts["running"]
            backlog = len([s for s in tr.sent if s.expect == "complete"]) - counts["completed"]
            if backlog < 100 and open_rows < 100:
                for _ in range(25):
                    kind, args = fuzz_case(rng, i, tag)
                    i += 1
                    if rng.random() < 0.75 or args.get("raw") or "duplicate" in kind:
                        kind, args = (
                            "valid",
                            {
                                "body": encode_request(
                                    id=f"fz-{tag}-{i}-v",
                                    prompt_token_ids=[rng.randrange(3, 40000) for _ in range(6)],
                                    sampling={"max_tokens": rng.randint(1, 24), "ignore_eos": True},
                                ),
                                "rid": f"fz-{tag}-{i}-v",
                                "expect": "complete",
                            },
                        )
                    body = args.pop("body")
                    try:
                        await tr.publish(body, kind=kind, **args)
                    except Exception:
                        tr.sent.pop()  # the broker may or may not have it: not counted
                        unconfirmed += 1
                        await tr.disconnect()
                        break
            rss.append(rss_bytes(a.proc.pid))
            if time.monotonic() >= next_fault:
                which = ("rabbitmq restart", "postgres outage", "kill -9")[turn % 3]
                turn += 1
                await tr.disconnect()
                if which == "rabbitmq restart":
                    await restart_rabbitmq(h.amqp_url)
                elif which == "postgres outage":
                    async with postgres_down():

                        async def noticed() -> bool:
                            m = [await asyncio.to_thread(scrape, p) for p in ports]
                            return all(x.get("kvflow_ledger_write_errors_total", 0) > 0 for x in m)

                        with contextlib.suppress(TimeoutError):
                            await wait_for("failed ledger writes", noticed, 20, every=0.5)
                    await h.db.dispose()
                else:
                    b.proc.send_signal(signal.SIGKILL)
                    await b.wait(30)
                    b = h.start("soak-b", model=model, max_num_seqs=8, extra=metrics_args(ports[1]))
                    await h.ready(b)
                faults[which] += 1
                next_fault = time.monotonic() + fault_every_s
            await asyncio.sleep(0.5)
        tally = await tr.settle(timeout=300)
    tally.notes["faults"] = dict(faults)
    tally.notes["unconfirmed publishes (not counted)"] = unconfirmed
    tally.notes["worker A alive"] = a.alive()
    if len(rss) >= 10:
        tenth = max(1, len(rss) // 10)
        first, last = rss[tenth], max(rss[-tenth:])
        tally.notes["worker A RSS MiB (after warm-up, last tenth max)"] = (
            round(first / 2**20),
            round(last / 2**20),
        )
    return tally


async def _statuses_all(h: Harness) -> Counter[str]:
    from sqlalchemy import func, select

    from worker.ledger.tables import requests as t

    async with h.db.connect() as conn:
        result = (await conn.execute(select(t.c.status, func.count()).group_by(t.c.status))).all()
    return Counter({s: int(n) for s, n in result})


def _death(headers: dict[str, Any]) -> str:
    """`reason from queue, count n` of a dead letter's first x-death entry."""
    deaths = headers.get("x-death")
    if not isinstance(deaths, list) or not deaths or not isinstance(deaths[0], dict):
        return "no x-death header"
    d = deaths[0]
    return f"{d.get('reason')} from {d.get('queue')}, count {d.get('count')}"


def _same_final(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two final replies say the same: type, text or error, token ids."""
    keys = ("type", "text", "error", "token_ids", "finish_reason")
    return all(a.get(k) == b.get(k) for k in keys)
