"""The admin CLI end to end: `kvflow drain | resume | workers | status | scale | up |
cancel | dlq | ledger` as subprocesses, against real RabbitMQ and PostgreSQL and real
worker processes running the tiny random-weight model.

Each test has its own `test.<hex>` queues (KVFLOW_EXCHANGE and KVFLOW_QUEUE point at
them) and its own migrated ledger schema. The control exchange is shared by every
worker on the broker, so the tests address workers by id (or by queue, as `--all`
does), never all of them at once. Where a test needs work to be in progress (a drain,
a cancel, a scale-up under load), a gate holds marked requests (tests/integration/fleet.py):
nothing depends on how fast this machine runs a request.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import msgpack
import pytest

from broker.client import Handle, RequestFailed
from broker.topology import Topology, declare
from tests.integration.fleet import READY_TIMEOUT_S, Env, first_delta
from tests.integration.helpers import eventually, stored
from worker.admin.queues import queue_counts
from worker.ledger.migrate import upgrade_async
from worker.ledger.tables import requests as requests_table

pytestmark = pytest.mark.integration


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


async def is_draining(env: Env, wid: str) -> bool:
    return (await env.worker_rows())[wid]["state"] == "draining"


@pytest.mark.timeout(150)
async def test_drain_finishes_running_work_then_resume_serves_the_rest(env: Env) -> None:
    gate = env.gate()
    w = env.worker("drain", max_num_seqs=2, gate=gate)
    await env.ready(w)
    n = 12
    held = await env.submit_long("d-held", 50, held=True, stream=True)
    await first_delta(held)  # running, and it stops there until the gate opens
    handles = [held] + [await env.submit_long(f"d-{i}", 50, held=True) for i in range(n - 1)]

    async def took_more() -> bool:
        return len(await env.running_on(w.name)) >= 2

    await eventually(took_more, "the worker to take more than the held request")
    drain = asyncio.create_task(env.kvflow("drain", w.name, "--timeout", "120", "--json"))
    await eventually(lambda: is_draining(env, w.name), "the worker to report draining")
    taken = set(await env.running_on(w.name))  # at least: a mark may still be in flight
    gate.open()  # what it holds can finish now: the drain waits for it
    doc = (await drain).ok().json
    assert [r["worker"] for r in doc["drained"]] == [w.name], doc
    drained = doc["drained"][0]["info"]
    assert drained["state"] == "drained" and drained["requeued"] == 0, drained
    assert drained["running"] == 0 and drained["held"] == 0, drained

    # it finished what it had taken, and pulls nothing new
    rows = await env.rows()
    finished = {rid for rid, r in rows.items() if r["status"] == "completed"}
    assert taken <= finished, (finished, taken)
    assert not [rid for rid, r in rows.items() if r["status"] == "running"], rows
    ready = await env.ready_count()
    assert ready == n - len(finished), (ready, finished)
    await env.heartbeats(w.name, 5)  # its loop (intake included) kept running
    assert await env.ready_count() == ready, "a drained worker pulled new messages"
    assert set(await env.rows()) == set(rows), "a drained worker took a request"
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
        assert row["status"] == "completed" and row["completion_tokens"] == 50, row
        assert row["attempts"] == 1, f"{h.id} ran twice: {row}"
        assert stored(result["text"]) == row["output_text"]
    assert await env.dead_count() == 0
    assert w.alive(), w.tail()


@pytest.mark.timeout(150)
async def test_drain_past_its_timeout_requeues_and_resume_completes(env: Env) -> None:
    gate = env.gate()
    w = env.worker("requeue", max_num_seqs=8, gate=gate)
    await env.ready(w)
    n = 24
    held = await env.submit_long("r-held", 60, held=True, stream=True)
    await first_delta(held)  # every request here is held after its first token
    handles = [held] + [await env.submit_long(f"r-{i}", 60, held=True) for i in range(n - 1)]

    async def batch_taken() -> bool:
        return len(await env.running_on(w.name)) >= 8

    await eventually(batch_taken, "a full batch taken by the worker")
    drain = ("drain", "--all", "--window", "1", "--timeout", "0.5", "--json")
    doc = (await env.kvflow(*drain)).ok().json
    assert doc["targets"] == [w.name], doc  # --all: the workers of this queue only
    info = doc["drained"][0]["info"]
    assert info["state"] == "drained" and info["requeued"] >= 8, info
    assert info["running"] == 0 and info["held"] == 0, info

    async def requeued() -> bool:
        return await env.ready_count() == n

    await eventually(requeued, "every request back in the queue", timeout=20)
    assert await _completed(env) == 0
    assert await env.dead_count() == 0, "a drained request was dead-lettered"

    gate.open()
    resumed = (await env.kvflow("resume", "--all", "--json")).ok().json
    assert [r["worker"] for r in resumed["acks"]] == [w.name], resumed
    outcomes = await results(handles, timeout=120)
    rows = await env.settled([h.id for h in handles])
    again = [rid for rid, r in rows.items() if r["attempts"] >= 2]
    assert len(again) >= 8 and "r-held" in again, f"not requeued: {rows}"
    for h, result in zip(handles, outcomes, strict=True):
        row = rows[h.id]
        assert row["status"] == "completed" and row["completion_tokens"] == 60, row
        assert stored(result["text"]) == row["output_text"]
    assert await env.dead_count() == 0
    assert await env.ready_count() == 0


async def _completed(env: Env) -> int:
    return sum(r["status"] == "completed" for r in (await env.rows()).values())


# -- scale with a supervisor --


@pytest.mark.timeout(240)
async def test_scale_up_and_down_under_load(env: Env) -> None:
    gate = env.gate()
    sup = env.up(workers=1, gate=gate)

    async def live_workers() -> dict[str, dict[str, Any]]:
        doc = (await env.kvflow("workers", "--json")).ok().json
        return {wid: w for wid, w in by_worker(doc).items() if w["alive"]}

    async def one_live() -> bool:
        if not sup.alive():
            pytest.fail(f"kvflow up exited with {sup.proc.returncode}:\n{sup.tail()}")
        return len(await env.worker_rows()) == 1

    await eventually(one_live, "the supervisor's first worker", timeout=READY_TIMEOUT_S)
    # Every request is held after its first token (the gate): what the first worker took
    # stays with it, so the rest of the load can only be served by the workers the
    # scale-up adds.
    n = 48
    held = await env.submit_long("s-held", 40, held=True, stream=True)
    await first_delta(held)
    handles = [held] + [await env.submit_long(f"s-{i}", 40, held=True) for i in range(n - 1)]

    up3 = (await env.kvflow("scale", "3", "--json")).ok().json
    assert len(up3["done"]) == 1, up3
    done = up3["done"][0]["info"]
    assert done["from"] == 1 and done["to"] == 3 and len(done["started"]) == 2, done
    assert done["not_ready"] == [], done
    live = await live_workers()
    assert len(live) == 3 and set(done["started"]) <= set(live), live
    assert all(w["status"] == "serving" and w["queue"] == env.topo.queue for w in live.values())

    async def newcomers_serve() -> bool:
        rows = await env.rows()
        return set(done["started"]) <= {r["worker_id"] for r in rows.values()}

    await eventually(newcomers_serve, "the new workers to take requests", timeout=60)
    gate.open()

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
        assert row["status"] == "completed" and row["completion_tokens"] == 40, row
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
    gate = env.gate()
    w = env.worker("cancel", max_num_seqs=4, gate=gate)
    await env.ready(w)
    with pytest.raises(RequestFailed) as info:
        await queued.result(30)
    assert info.value.code == "cancelled"
    row = (await env.settled(["c-queued"]))["c-queued"]
    assert row["status"] == "cancelled" and row["error_code"] == "cancelled", row
    assert row["first_token_at"] is None and row["output_text"] is None, "it ran"

    # running: held by the gate after its first token, so it is surely mid-way
    running = await env.submit_long("c-running", 240, held=True, stream=True)
    await first_delta(running)
    others = [await env.submit_long("c-other-0", 8)]
    doc = (await env.kvflow("cancel", "c-running", "--json")).ok().json
    assert doc["outcome"] == "cancelled" and doc["running_on"] == w.name, doc
    assert not doc["ledger_written"], doc
    with pytest.raises(RequestFailed) as info:
        await running.result(30)
    assert info.value.code == "cancelled"
    row = (await env.rows(["c-running"]))["c-running"]
    assert row["status"] == "cancelled", row
    assert 0 < row["completion_tokens"] < 240, f"not aborted mid-way: {row}"
    gate.open()

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


async def test_queue_counts_ready_and_unacked(
    amqp_url: str, amqp_connection: Any, rabbit_topology: Topology
) -> None:
    declared = await declare(await amqp_connection.channel(), rabbit_topology)
    for body in (b"a", b"b"):
        await declared.exchange.publish(aio_pika.Message(body), routing_key=rabbit_topology.queue)
    held = await eventually(lambda: declared.queue.get(fail=False), "a message")
    # Ready is exact at once; unacked comes from the quorum queue's ~5 s metrics tick.
    assert (await queue_counts(amqp_url, rabbit_topology.queue))[0] == 1

    async def settled() -> bool:
        return await queue_counts(amqp_url, rabbit_topology.queue) == (1, 1)

    await eventually(settled, "1 ready and 1 unacked", timeout=30, every=1.0)
    await held.ack()
    with pytest.raises(LookupError, match="not found"):
        await queue_counts(amqp_url, f"{rabbit_topology.queue}.missing")
    # No management API there: a clear error, not a hang or a traceback.
    with pytest.raises(RuntimeError, match=r"no management API at http://127\.0\.0\.1:1 "):
        await queue_counts(amqp_url, rabbit_topology.queue, management_url="http://127.0.0.1:1")


@pytest.mark.timeout(150)
async def test_status_and_ledger_commands_match_what_was_sent(env: Env, tmp_path: Path) -> None:
    w = env.worker("status", max_num_seqs=4)
    await env.ready(w)
    n = 10
    handles = [
        await env.submit_long(f"st-{i}", 8 + i, client="svc-a" if i < 5 else "svc-b")
        for i in range(n)
    ]
    outcomes = await results(handles, timeout=60)
    rows = await env.settled([h.id for h in handles])
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
    clients = {c["client"]: c for c in doc["clients"]}  # service received per client
    for name, ids in (("svc-a", range(5)), ("svc-b", range(5, 10))):
        mine = [rows[f"st-{i}"] for i in ids]
        served = sum(r["prompt_tokens"] + 2 * r["completion_tokens"] for r in mine)
        assert clients[name]["requests"] == 5 and clients[name]["service"] == served, clients
        assert clients[name]["ttft_p50_s"] > 0, clients
    human = (await env.kvflow("status")).ok().out
    assert "svc-a" in human and "SHARE" in human, human

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
