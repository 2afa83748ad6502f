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
from tests.integration.harness import Harness

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
