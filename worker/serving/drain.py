"""Whether the worker takes new work, and which requests it must give back or cancel.

One `DrainState` per worker, handed to the intake (it pulls only while resumed), to the
delivery (it checks, just before a request enters the engine, that the worker still
accepts it and nobody cancelled it) and to the control plane (pause, resume, cancel).
Nothing else holds drain or cancel state.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Iterable


class GiveBack(enum.Enum):
    """Why a running request goes back to the queue instead of finishing here."""

    REQUEUE = "requeue"  # a drain, an error of this worker: a broker requeue (it counts)
    ENGINE_DOWN = "engine down"  # the engine died; it was not running: not its fault
    CRASHED = "crashed"  # running with others when the engine died: a suspect
    CRASHED_ALONE = "crashed alone"  # the only request running when the engine died


class DrainState:
    """Pulling (paused or resumed), accepting, the ids to give back and the ids cancelled."""

    def __init__(self, keep_cancelled: int = 10_000) -> None:
        self._resumed = asyncio.Event()
        self._accepting = True
        self._give_back: dict[str, GiveBack] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._keep_cancelled = keep_cancelled

    # -- pulling ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        """Stop pulling new messages; what runs goes on."""
        self._resumed.clear()

    def resume(self) -> None:
        """Pull again, and let new requests into the engine again."""
        self._accepting = True
        self._resumed.set()

    async def wait_resumed(self) -> None:
        await self._resumed.wait()

    # -- entering the engine ---------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False once the worker gives work back: requests not yet in the engine return to
        the queue instead of starting."""
        return self._accepting

    def give_back(self, request_ids: Iterable[str], why: GiveBack = GiveBack.REQUEUE) -> None:
        """Stop accepting; these running requests, once aborted, go back to the queue
        (not cancelled), for the reason `why`."""
        self._accepting = False
        self._give_back.update(dict.fromkeys(request_ids, why))

    def given_back(self, request_id: str) -> GiveBack | None:
        """Why `request_id` goes back to the queue (None: it was not given back)."""
        return self._give_back.get(request_id)

    def forget(self, request_id: str) -> None:
        """The delivery of `request_id` is settled."""
        self._give_back.pop(request_id, None)

    # -- cancel ----------------------------------------------------------------------------

    def cancel_on_arrival(self, request_id: str) -> None:
        """Remember a cancel for a request not here yet (bounded, oldest forgotten first)."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > self._keep_cancelled:
            self._cancelled.popitem(last=False)

    def take_cancelled(self, request_id: str) -> bool:
        """True (once) if an operator cancelled `request_id` before it started."""
        return self._cancelled.pop(request_id, 0) is None
