"""An optional record of every engine step, for tests and plots (off unless asked for).

With KVFLOW_STEP_LOG=PATH in its environment, an engine appends one JSON line per step
to PATH: `{"step", "t", "scheduled": [[request_id, client, tokens, is_decode], ...],
"waiting": {client: requests waiting}}`. The fairness test reads it from a worker it runs
as a subprocess; the continuous-batching timeline is drawn from it.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import IO

from worker.engine.outputs import SchedulerOutput
from worker.engine.scheduler import Scheduler

ENV = "KVFLOW_STEP_LOG"


class StepLog:
    def __init__(self, file: IO[str]) -> None:
        self.file = file

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepLog | None:
        path = (os.environ if env is None else env).get(ENV)
        return cls(open(path, "a", encoding="utf-8")) if path else None

    def write(self, sched: SchedulerOutput, scheduler: Scheduler) -> None:
        requests = scheduler.requests
        line = {
            "step": sched.step,
            "t": time.time(),
            "scheduled": [
                [s.request_id, requests[s.request_id].client, s.num_new_tokens, s.is_decode]
                for s in sched.scheduled
            ],
            "waiting": dict(Counter(r.client for r in scheduler.policy)),
        }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
