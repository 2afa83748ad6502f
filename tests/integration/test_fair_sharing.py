"""Fair share between client services through RabbitMQ: two v1 producers, one backlog.

Client A publishes a backlog ten times larger than client B's few requests, then B
publishes; both publish exactly as contract v1 says (to the exchange, routing key the
queue), A naming itself in the AMQP app_id, B in the body. The worker (fair mode) routes
them into lanes and takes from those in fair order; the engine shares the batch by
service received. Its step log (KVFLOW_STEP_LOG) says what each step computed for whom.

B publishes once A's backlog has left the shared queue for A's lane (the worker's
heartbeat counts what its router moved): a request published behind a burst still in
the shared queue waits for the router to move the burst first (the router moves
messages much faster than the engine serves them, but not instantly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.integration.harness import REPO, Harness
from tests.integration.helpers import eventually
from worker.engine.fairness import DECODE_WEIGHT, PREFILL_WEIGHT

pytestmark = pytest.mark.integration

MAX_SEQS = 8
WINDOW = 50


def body(rid: str, client: str | None, max_tokens: int) -> bytes:
    data: dict[str, Any] = {
        "id": rid,
        "prompt_token_ids": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if client is not None:
        data["client"] = client
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def read_steps(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("wa", "wb"), [(1, 1), (1, 3)])
async def test_a_backlog_does_not_starve_a_few_requests_and_service_follows_weights(
    harness: Harness, tiny_dir: Path, tmp_path: Path, wa: int, wb: int
) -> None:
    h = harness
    steps_path = tmp_path / "steps.jsonl"
    w = h.start(
        "fair",
        model=tiny_dir,
        max_num_seqs=MAX_SEQS,
        # a deeper look-ahead keeps every client's requests waiting in the engine however
        # fast the engine is next to the broker round trips that feed it
        extra=["--policy", "fair", "--client-weights", f"a={wa},b={wb}", "--lookahead", "6"],
        env={"KVFLOW_STEP_LOG": str(steps_path)},
    )
    await h.ready(w)
    tag = uuid.uuid4().hex[:6]
    a_ids = [f"a-{tag}-{i}" for i in range(600)]
    b_ids = [f"b-{tag}-{i}" for i in range(60)]
    for rid in a_ids:  # client A: its name in the AMQP app_id
        await h.publish_raw(body(rid, None, 8), rid, app_id="a")

    async def a_waiting_in_its_lane() -> bool:  # moved out of the shared queue, and served
        row = (await h.worker_rows()).get(w.id)
        rows = await h.rows(a_ids)
        running = sum(r["status"] == "running" for r in rows.values())
        return row is not None and row["info"]["routed"] >= len(a_ids) and running >= MAX_SEQS

    await eventually(a_waiting_in_its_lane, "client A's backlog in its lane", timeout=60)
    b_published = time.time()  # the worker's step log uses this machine's clock too
    for rid in b_ids:  # client B: its name in the body
        await h.publish_raw(body(rid, "b", 8), rid)
    rows = await h.settled([*a_ids, *b_ids], timeout=240)
    assert all(r["status"] == "completed" for r in rows.values())
    assert {rows[r]["client"] for r in a_ids} == {"a"} and {rows[r]["client"] for r in b_ids} == {
        "b"
    }

    steps = read_steps(steps_path)
    first_step: dict[str, int] = {}
    for s in steps:
        for rid, _, _, _ in s["scheduled"]:
            first_step.setdefault(rid, s["step"])
    # B's first request is admitted before more than max_num_seqs further A requests
    b_first = min(first_step[r] for r in b_ids)
    after_b = {s["step"] for s in steps if s["t"] >= b_published}
    a_meanwhile = [r for r in a_ids if first_step[r] in after_b and first_step[r] < b_first]
    assert len(a_meanwhile) <= MAX_SEQS, (len(a_meanwhile), b_first)

    # While both have work not yet admitted, each one's share of service follows the
    # weights. Requests are not preempted for fairness, so B's share can start only as
    # the batch running when B arrived turns over: the windows start once it has.
    last_step: dict[str, int] = {}
    for s in steps:
        for rid, _, _, _ in s["scheduled"]:
            last_step[rid] = s["step"]
    at_arrival = next(s for s in steps if s["step"] == b_first)["scheduled"]
    turned_over = max(last_step[rid] for rid, _, _, _ in at_arrival) + 1
    a_last, b_last = max(first_step[r] for r in a_ids), max(first_step[r] for r in b_ids)
    both = [s for s in steps if turned_over <= s["step"] < min(a_last, b_last)]
    service: list[Counter[str]] = []
    for s in both:
        c: Counter[str] = Counter()
        for _, client, tokens, is_decode in s["scheduled"]:
            c[client] += (DECODE_WEIGHT if is_decode else PREFILL_WEIGHT) * tokens
        service.append(c)
    expected = wa / (wa + wb)
    shares = []
    for start in range(0, len(service) - WINDOW + 1, WINDOW):
        window: Counter[str] = sum(service[start : start + WINDOW], Counter())
        shares.append(window["a"] / (window["a"] + window["b"]))
    assert shares, f"no window of {WINDOW} steps with both clients waiting ({len(both)} steps)"
    assert all(abs(x - expected) <= 0.05 for x in shares), (expected, shares)

    # `kvflow status` shows the lanes (empty now) and the service each client received
    env = {**os.environ, "KVFLOW_QUEUE": h.topo.queue, "KVFLOW_CLIENT_WEIGHTS": f"a={wa},b={wb}"}
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--json", "--database-url", h.db_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    doc = json.loads(done.stdout)
    assert set(doc["lanes"]) == {"a", "b", "other"}, doc.get("lanes")
    assert all(n["ready"] == 0 for n in doc["lanes"].values()), doc["lanes"]
    served = {c["client"]: c for c in doc["clients"]}
    assert served["a"]["requests"] == len(a_ids) and served["b"]["requests"] == len(b_ids)
