"""Faults, load, hostile input and credentials, against the real RabbitMQ and PostgreSQL,
sized for CI. The scenarios live in tests/integration/stress.py; `python ops/stress/run.py
--big` runs the same ones at full size.

Every request must end exactly once: one terminal ledger row, one final reply to the
queue it named (a durable quorum queue here, so replies survive a broker restart),
nothing dead-lettered that should have completed. RabbitMQ and PostgreSQL outages hold
the machine's service lock (stress.SERVICES_LOCK) while the service is down.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import stress
from tests.integration.harness import LOOKAHEAD, Harness

pytestmark = pytest.mark.integration


def check(tally: stress.Tally) -> None:
    print(tally.summary())
    assert tally.clean, tally.summary()


# -- faults --


@pytest.mark.timeout(420)
async def test_rabbitmq_restart_mid_run_loses_and_repeats_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.rabbitmq_restart(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert tally.notes["workers alive"] == 2, tally.summary()
    # the outage shows: requests in flight came back redelivered, the log says why
    assert tally.notes["redelivered"] > 0, tally.summary()
    assert all(tally.notes["logs"]), tally.summary()


@pytest.mark.timeout(420)
async def test_postgres_down_mid_run_loses_and_repeats_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.postgres_outage(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert tally.notes["workers alive"] == 2, tally.summary()
    assert all(e > 0 for e in tally.notes["write errors"]), tally.summary()
    assert all(tally.notes["logs"]), tally.summary()


@pytest.mark.timeout(420)
async def test_a_worker_killed_twice_while_another_serves_loses_nothing(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.kill_twice(harness, tiny_dir)
    check(tally)
    assert tally.completed == tally.requests
    assert all(k > 0 for k in tally.notes["killed while running"]), tally.summary()
    assert tally.notes["B alive"], tally.summary()


# -- load --

N_LOAD = 2000
LOAD_SEQS = 8


@pytest.mark.timeout(600)
async def test_thousands_of_short_requests_to_two_workers(harness: Harness, tiny_dir: Path) -> None:
    """Every request exactly once; each worker holds at most its window unacked; resident
    memory after warm-up (the first fifth) grows by at most 10%."""
    tally, held, mem = await stress.load(harness, tiny_dir, N_LOAD, max_num_seqs=LOAD_SEQS)
    check(tally)
    assert tally.completed == N_LOAD
    cap = LOAD_SEQS + LOOKAHEAD
    for wid in (w.id for w in mem.workers):
        assert 0 < held.max_running[wid] <= cap, tally.summary()
        assert held.max_held[wid] <= cap, tally.summary()
    growth = mem.growth(warm_from=N_LOAD // 5)
    print("rss growth after warm-up", growth)
    assert len(growth) == 2 and all(g <= 1.10 for g in growth.values()), growth


# -- hostile input --

N_FUZZ = 3000


@pytest.mark.timeout(600)
async def test_fuzzed_messages_are_each_answered_or_dead_lettered(
    harness: Harness, tiny_dir: Path
) -> None:
    tally = await stress.fuzz(harness, tiny_dir, N_FUZZ, seed=20261130)
    check(tally)
    assert tally.notes["alive"], tally.summary()
    assert tally.rejected > N_FUZZ // 2 and tally.completed > N_FUZZ // 10, tally.summary()


# -- KV pressure --

N_KV = 200
KV_BLOCKS = 36


@pytest.mark.timeout(600)
async def test_kv_pressure_outputs_equal_an_unconstrained_run(
    harness: Harness, tiny_dir: Path
) -> None:
    """Long greedy outputs through a pool of a few dozen blocks: preemption happens, every
    output equals the run with blocks to spare, no block stays in use, resident memory
    of the last hundred is within 10% of the first hundred's."""
    expected = stress.reference_outputs(tiny_dir, N_KV)
    tally, mem, _ = await stress.kv_pressure(harness, tiny_dir, N_KV, expected, KV_BLOCKS)
    check(tally)
    assert tally.completed == N_KV
    assert tally.notes["preemptions"] > 0, tally.summary()
    assert tally.notes["kv usage at end"] == 0, tally.summary()
    growth = mem.growth(warm_from=min(100, N_KV // 2), last_from=N_KV - 100)
    print("rss growth", growth)
    assert growth and all(g <= 1.10 for g in growth.values()), growth
