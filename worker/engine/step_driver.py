"""The step loop: commands applied at step boundaries, then a step, then one report.

Runs wherever the engine lives (a thread of this process or a child process); the
front (async_engine.py) only sends commands and reads reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.engine import Capacity, LLMEngine
from worker.engine.outputs import RequestOutput, StepStats
from worker.request import FinishReason, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    deadline: float | None
    client: str = "default"


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | Stop


@dataclass(frozen=True)
class StepReport:
    """What the step loop sends back after applying commands and (maybe) stepping."""

    outputs: list[RequestOutput]
    stats: StepStats | None
    capacity: Capacity
    added_tokens: int = 0  # prompt tokens of the adds applied since the last report
    added: int = 0
    stopped: bool = False
    error: str | None = None


@dataclass
class StepDriver:
    """Drives an LLMEngine: commands at step boundaries, then a step, then a report.

    `next_commands(block)` returns pending commands, waiting for one when `block`;
    `report(r)` sends a StepReport back to the front.
    """

    engine: LLMEngine
    next_commands: Callable[[bool], list[Command]]
    report: Callable[[StepReport], None]
    _pending_tokens: int = field(default=0, init=False)
    _pending: int = field(default=0, init=False)

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                cmds = self.next_commands(not engine.has_unfinished())
                outputs: list[RequestOutput] = []
                if self._apply(cmds, outputs):
                    outputs += engine.abort(list(engine.scheduler.requests))
                    self._send(outputs, None, stopped=True)
                    return
                stats = None
                if engine.has_unfinished():
                    outputs += engine.step()
                    stats = engine.last_stats
                    if stats is not None and stats.batch_size == 0 and not outputs:
                        time.sleep(0.001)  # nothing could be placed: don't spin
                if outputs or stats is not None or self._pending:
                    self._send(outputs, stats)
        except BaseException as e:  # the loop must never die silently
            log.exception("engine step loop failed")
            self._send([], None, stopped=True, error=f"engine failure: {e!r}")

    def _send(
        self,
        outputs: list[RequestOutput],
        stats: StepStats | None,
        stopped: bool = False,
        error: str | None = None,
    ) -> None:
        self.report(
            StepReport(
                outputs,
                stats,
                self.engine.capacity(),
                self._pending_tokens,
                self._pending,
                stopped,
                error,
            )
        )
        self._pending_tokens = self._pending = 0

    def _apply(self, cmds: list[Command], outputs: list[RequestOutput]) -> bool:
        """Apply commands; True when asked to stop."""
        stop = False
        for cmd in cmds:
            if isinstance(cmd, Add):
                self._pending_tokens += len(cmd.prompt_token_ids)
                self._pending += 1
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        arrival_time=cmd.arrival_time,
                        priority=cmd.priority,
                        deadline=cmd.deadline,
                        client=cmd.client,
                    )
                except ValueError as e:
                    outputs.append(
                        RequestOutput(
                            cmd.request_id, "", [], True, FinishReason.ABORT, error=str(e)
                        )
                    )
            elif isinstance(cmd, Abort):
                outputs += self.engine.abort(cmd.request_ids)
            else:
                stop = True
        return stop
