"""Test hooks in the step loop: inert unless the environment variable KVFLOW_TEST_HOOKS is set.

Tests must not depend on how long a step takes on the machine they run on. These hooks
let a test hold the engine at a known point, or make it fail like a real fault would,
from a worker it runs as a subprocess. `KVFLOW_TEST_HOOKS` is a JSON map:

``{"hold_token": T, "gate": PATH}``
    While the file PATH exists, a running request whose prompt contains token id T
    makes no progress once it has produced its first token: it keeps its place in the
    batch and cannot finish until the test removes the file. Other requests go on;
    aborts still apply.
``{"crash_token": T}``
    Scheduling a request whose prompt contains token id T ends the process at once
    (exit code 70), as an out-of-memory kill of the engine process would. Meant for the
    queue worker's engine process: a poison message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from worker.request import Request

ENV = "KVFLOW_TEST_HOOKS"
CRASH_EXIT_CODE = 70


@dataclass(frozen=True)
class TestHooks:
    hold_token: int | None = None
    gate: str | None = None
    crash_token: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TestHooks | None:
        raw = (os.environ if env is None else env).get(ENV)
        if not raw:
            return None
        spec = json.loads(raw)
        if not isinstance(spec, dict) or set(spec) - {"hold_token", "gate", "crash_token"}:
            raise ValueError(f"{ENV} must be a JSON map of hold_token, gate, crash_token")
        return cls(**spec)

    def held(self, running: Iterable[Request]) -> frozenset[str]:
        """Ids of the running requests to skip this step: marked ones that have started
        generating, while the gate is closed."""
        if self.hold_token is None or self.gate is None or not os.path.exists(self.gate):
            return frozenset()
        token = self.hold_token
        return frozenset(
            r.request_id for r in running if r.num_output_tokens > 0 and token in r.prompt_token_ids
        )

    def check_crash(self, scheduled: Iterable[Request]) -> None:
        if self.crash_token is None:
            return
        if any(self.crash_token in r.prompt_token_ids for r in scheduled):
            os._exit(CRASH_EXIT_CODE)
