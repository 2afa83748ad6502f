"""The values the ledger's text columns may hold, defined once for the code and the tables.

`LedgerStatus` is a request's status (`requests.status`): it moves forward only, queued ->
running -> one terminal status, and a terminal status is final. `WorkerState` is a
worker process's state; the `workers.state` column records all of them but `starting`
(a worker heartbeats only once its engine is up, and a starting one is recorded as
serving: `WorkerState.recorded`). `RequestSource` says which path wrote a request.
The tables' check constraints are built from these (worker/ledger/tables.py).
"""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.StrEnum)


class LedgerStatus(enum.StrEnum):
    """A request's status in the ledger."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """Final: no later record changes the row (see worker/ledger/store.py)."""
        return self not in ACTIVE

    @property
    def rank(self) -> int:
        """Order of the forward-only rule: queued 0, running 1, every terminal status 2."""
        return _RANK.get(self, 2)


class WorkerState(enum.StrEnum):
    """A worker process's state, as `kvflow workers` and the metrics show it."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPED = "stopped"

    @property
    def recorded(self) -> WorkerState:
        """The state the `workers` table records for this one (starting counts as serving)."""
        return WorkerState.SERVING if self is WorkerState.STARTING else self


class RequestSource(enum.StrEnum):
    """Which path wrote a request's row: the queue worker or `kvflow run-batch`."""

    QUEUE = "queue"
    BATCH = "batch"


ACTIVE = (LedgerStatus.QUEUED, LedgerStatus.RUNNING)
TERMINAL = tuple(s for s in LedgerStatus if s not in ACTIVE)
RECORDED_WORKER_STATES = tuple(s for s in WorkerState if s.recorded is s)
_RANK = {LedgerStatus.QUEUED: 0, LedgerStatus.RUNNING: 1}


def parse(kind: type[E], value: object, what: str) -> E:
    """`value` as a member of `kind`; ValueError naming `what` and the allowed values."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value in kind._value2member_map_:
        return kind(value)
    allowed = ", ".join(m.value for m in kind)
    raise ValueError(f"{what} {value!r} is not one of {allowed}")
