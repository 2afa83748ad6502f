"""The ledger's values and records: enums shared with the tables' constraints, validation,
and the merge rule (no database)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from worker.ledger import LedgerStatus, RequestRecord, WorkerRecord, WorkerState, merge
from worker.ledger.tables import requests, workers


def test_check_constraints_are_built_from_the_enums() -> None:
    (status,) = [c for c in requests.constraints if c.name == "ck_requests_status"]
    assert str(status.sqltext) == "status IN ({})".format(
        ", ".join(f"'{s.value}'" for s in LedgerStatus)
    )
    (state,) = [c for c in workers.constraints if c.name == "ck_workers_state"]
    assert "'starting'" not in str(state.sqltext)
    assert all(f"'{s.value}'" in str(state.sqltext) for s in WorkerState if s.recorded is s)
    assert [s.value for s in LedgerStatus if s.terminal] == [
        "completed",
        "failed",
        "rejected",
        "expired",
        "cancelled",
    ]


def test_records_take_only_known_values() -> None:
    assert RequestRecord("a", "queued").status is LedgerStatus.QUEUED
    with pytest.raises(ValueError, match="status 'done' is not one of queued, running"):
        RequestRecord("a", "done")
    with pytest.raises(ValueError, match="source 'cli' is not one of queue, batch"):
        RequestRecord("a", "queued", source="cli")
    with pytest.raises(ValueError, match="timezone-aware"):
        RequestRecord("a", "queued", received_at=datetime(2025, 1, 1))
    assert WorkerRecord("w", WorkerState.STARTING).state == WorkerState.SERVING  # as recorded
    with pytest.raises(ValueError, match="state 'sleeping' is not one of starting"):
        WorkerRecord("w", "sleeping")


def test_merge_moves_forward_and_a_final_record_is_final() -> None:
    now = datetime.now(UTC)
    queued = RequestRecord("a", "queued", prompt="p", priority=1)
    running = merge(queued, RequestRecord("a", "running", worker_id="w", attempts=1))
    assert (running.status, running.prompt, running.worker_id) == ("running", "p", "w")
    assert merge(running, RequestRecord("a", "queued", prompt="late")).status == "running"
    done = merge(running, RequestRecord("a", "completed", finished_at=now, attempts=0))
    assert (done.status, done.attempts, done.finished_at) == ("completed", 1, now)
    assert merge(done, RequestRecord("a", "failed", error="x")) is done
