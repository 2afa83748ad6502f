"""Fair share between client services through RabbitMQ: two v1 producers, one backlog.

Client A publishes a backlog ten times larger than client B's few requests, then B
publishes; both publish exactly as contract v1 says (to the exchange, routing key the
queue), A naming itself in the AMQP app_id, B in the body. The worker (fair mode) routes
them into lanes and takes from those in fair order; the engine shares the batch by
service received. Its step log (KVFLOW_STEP_LOG) says what each step computed for whom
and what each client had waiting in the engine.

What the engine decides must not depend on how fast this machine's broker round trips
are next to its steps (on a loaded 2-core machine the tiny model steps faster than the
intake feeds it, and then the intake, not the policy, decides who runs). So the test
holds the batch with eight held requests of a third client (the harness's gate) while
the lanes fill the engine's waiting queue with all of B's requests and a look-ahead of
A's, and only then releases it: from there every admission while B has work is the
engine's choice between both clients, whatever the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.integration.harness import HOLD, REPO, Harness
from tests.integration.helpers import eventually
from worker.engine.fairness import DECODE_WEIGHT, PREFILL_WEIGHT

pytestmark = pytest.mark.integration

MAX_SEQS = 8
WINDOW = 50
A_REQUESTS, B_REQUESTS = 600, 60
# Requests per client the worker keeps waiting in its engine: all of B's, and as many of
# A's, so A still has requests waiting when B's last one is admitted.
LOOKAHEAD = B_REQUESTS + 4


def body(rid: str, client: str | None, max_tokens: int, prompt: list[int] | None = None) -> bytes:
    data: dict[str, Any] = {
        "id": rid,
        "prompt_token_ids": prompt or [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if client is not None:
        data["client"] = client
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if lines and not lines[-1].endswith("}"):
        lines.pop()  # a line the engine is writing now
    return [json.loads(line) for line in lines if line]


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
        extra=[
            *("--policy", "fair", "--client-weights", f"a={wa},b={wb}"),
            *("--lookahead", str(LOOKAHEAD)),
        ],
        env={"KVFLOW_STEP_LOG": str(steps_path)},
    )
    await h.ready(w)
    tag = uuid.uuid4().hex[:6]
    held_ids = [f"h-{tag}-{i}" for i in range(MAX_SEQS)]
    a_ids = [f"a-{tag}-{i}" for i in range(A_REQUESTS)]
    b_ids = [f"b-{tag}-{i}" for i in range(B_REQUESTS)]

    # A third client's requests fill the batch and sit still after their first token.
    h.hold()
    for rid in held_ids:
        await h.publish_raw(body(rid, "h", 8, [HOLD, 5, 6, 7]), rid)

    async def batch_held() -> bool:
        steps = read_steps(steps_path)
        started = {r[0] for s in steps for r in s["scheduled"]}
        return set(held_ids) <= started and steps[-1]["scheduled"] == []

    await eventually(batch_held, "the batch full of held requests", timeout=60)
    for rid in a_ids:  # client A: its name in the AMQP app_id
        await h.publish_raw(body(rid, None, 8), rid, app_id="a")
    for rid in b_ids:  # client B, behind A's backlog: its name in the body
        await h.publish_raw(body(rid, "b", 8), rid)

    async def both_waiting() -> bool:
        steps = read_steps(steps_path)
        waiting = steps[-1]["waiting"] if steps else {}
        return waiting.get("b", 0) == B_REQUESTS and waiting.get("a", 0) >= B_REQUESTS

    await eventually(
        both_waiting, "all of B's requests and A's look-ahead in the engine", timeout=120
    )
    h.release()
    rows = await h.settled([*held_ids, *a_ids, *b_ids], timeout=240)
    assert all(r["status"] == "completed" for r in rows.values())
    assert {rows[r]["client"] for r in a_ids} == {"a"} and {rows[r]["client"] for r in b_ids} == {
        "b"
    }

    steps = [s for s in read_steps(steps_path) if s["scheduled"]]
    first_step: dict[str, int] = {}
    last_step: dict[str, int] = {}
    for s in steps:
        for rid, _, _, _ in s["scheduled"]:
            first_step.setdefault(rid, s["step"])
            last_step[rid] = s["step"]
    # B was behind 600 of A's requests in the queue, yet no A request is admitted before
    # B's first while B waits in the engine: B's counter starts no higher than A's, and it
    # runs fewer.
    b_first = min(first_step[r] for r in b_ids)
    a_before_b = [r for r in a_ids if first_step[r] < b_first]
    assert a_before_b == [], (len(a_before_b), b_first)

    # While both clients have requests waiting in the engine (every step from the release
    # until B's last admission, by construction; checked), each one's share of service
    # follows the weights. Requests are not preempted for fairness, so the shares start
    # once the held batch has turned over.
    turned_over = max(last_step[r] for r in held_ids) + 1
    a_last, b_last = max(first_step[r] for r in a_ids), max(first_step[r] for r in b_ids)
    both = [s for s in steps if turned_over <= s["step"] < min(a_last, b_last)]
    contested = [s for s in both if s["waiting"].get("a", 0) and s["waiting"].get("b", 0)]
    assert len(contested) >= len(both) - 1, (len(contested), len(both))
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


@pytest.mark.timeout(180)
async def test_a_burst_worker_in_fair_mode_serves_the_whole_queue_then_exits(
    harness: Harness, tiny_dir: Path
) -> None:
    """`--burst` in fair mode, end to end: requests published before the worker starts
    wait in the request queue, not in any lane, and every one is served (through the
    router, then the lanes) before the worker exits, with status 0. (That burst mode
    also waits for what the router still holds is tests/unit/test_lane_intake.py's and
    tests/unit/test_router.py's.)"""
    h = harness
    ids = [f"burst-{uuid.uuid4().hex[:6]}-{i}" for i in range(30)]
    handles = [
        await h.client.submit(
            prompt_token_ids=[5, 6, 7, 8 + i],
            id=rid,
            max_tokens=4,
            ignore_eos=True,
            client="a" if i % 3 else "b",
        )
        for i, rid in enumerate(ids)
    ]
    w = h.start(
        "burst",
        model=tiny_dir,
        max_num_seqs=4,
        extra=["--policy", "fair", "--client-weights", "a=1,b=1", "--burst"],
    )

    async def exited() -> bool:
        return not w.alive()

    await eventually(exited, "the burst worker to exit", timeout=150, every=0.2)
    assert w.proc.returncode == 0, w.tail()
    finals = [await handle.result(timeout=10) for handle in handles]
    assert [f["id"] for f in finals] == ids
    rows = await h.rows(ids)
    assert sorted(rows) == sorted(ids)
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert Counter(r["client"] for r in rows.values()) == {"a": 20, "b": 10}
