"""Fair mode's intake: takes from the clients' lanes in fair order, only what it can place.

One message at a time (basic.get) from the lane `Lanes.next_lane` names: the client that
holds the least in this worker for its weight, among lanes not found empty lately and
not over their queued-token limit. So when client B's first request reaches its lane,
it is taken at the next free place, however long client A's backlog; the engine's fair
policy then shares the batch between what is here by service received.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractQueue

from worker.serving.intake import Intake
from worker.serving.lanes import Lane, Lanes

log = logging.getLogger(__name__)


class LaneIntake(Intake):
    """Takes from the lanes of `lanes` in fair order, on `channel`."""

    def __init__(self, channel: AbstractChannel, lanes: Lanes, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.lanes = lanes
        self._queues: dict[str, AbstractQueue] = {}

    async def run(self) -> None:
        while not self._stopping.is_set():
            room = self.held < self.flow.max_held and self.flow.has_room(self.engine.capacity())
            if self.drain.paused or not room:
                await self._wait_for_change()
                continue
            lane = self.lanes.next_lane()
            if lane is None:
                if self.burst and not self._held and self.lanes.all_empty:
                    log.info("every lane empty and nothing in flight: burst mode ends")
                    return
                await self._wait_for_change(self.lanes.poll_max_s)
                continue
            try:
                queue = await self._queue(lane)
                message = await queue.get(no_ack=False, fail=False, timeout=10)
            except Exception as e:  # a closed channel: the robust connection reopens it
                log.warning("pull from %s failed (%r); retrying", lane.queue, e)
                await asyncio.sleep(0.5)
                continue
            if message is None:
                self.lanes.found_empty(lane)
                continue
            self.lanes.took(lane.client)
            await self._delivered(message, functools.partial(self.lanes.settled, lane.client))

    async def _queue(self, lane: Lane) -> AbstractQueue:
        queue = self._queues.get(lane.queue)
        if queue is None:
            queue = self._queues[lane.queue] = await self.channel.get_queue(
                lane.queue, ensure=False
            )
        return queue
