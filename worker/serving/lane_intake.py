"""Fair mode's intake: takes from the clients' lanes in fair order, only what it can place.

A message at a time per puller (basic.get; several pullers, each on its own channel,
keep gets in flight) from the lane `Lanes.next_lane` names: the client that received the
least service for its weight, among lanes not found empty lately and not over their
queued-token limit. So when client B's first request reaches its lane,
it is taken at the next free place, however long client A's backlog; the engine's fair
policy then shares the batch between what is here by service received.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractQueue

from worker.serving.intake import Intake
from worker.serving.lanes import Lane, Lanes

log = logging.getLogger(__name__)


class LaneIntake(Intake):
    """Takes from the lanes of `lanes` in fair order: `pullers` gets in flight at once,
    each on a channel of its own (a channel runs one RPC at a time)."""

    def __init__(
        self,
        channels: list[AbstractChannel],
        lanes: Lanes,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.channels = channels
        self.lanes = lanes
        self._in_flight = 0
        self._queues: dict[tuple[int, str], AbstractQueue] = {}

    async def run(self) -> None:
        pullers = [asyncio.create_task(self._pull(i)) for i in range(len(self.channels))]
        try:
            done, _ = await asyncio.wait(pullers, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a puller's failure ends the intake (the service stops)
        finally:
            self.stop()
            await asyncio.gather(*pullers, return_exceptions=True)

    async def _pull(self, index: int) -> None:
        while not self._stopping.is_set():
            taking = self.held + self._in_flight
            room = taking < self.flow.max_held and self.flow.has_room(self.engine.capacity())
            if self.drain.paused or not room:
                await self._wait_for_change()
                continue
            lane = self.lanes.next_lane()
            if lane is None:
                if self.burst and not self._held and not self._in_flight and self.lanes.all_empty:
                    log.info("every lane empty and nothing in flight: burst mode ends")
                    return
                await self._wait_for_change(self.lanes.poll_max_s)
                continue
            self._in_flight += 1
            ticket = self.lanes.take(lane)  # counted before the get: pullers see it
            try:
                message = await (await self._queue(index, lane)).get(
                    no_ack=False, fail=False, timeout=10
                )
            except Exception as e:  # a closed channel: the robust connection reopens it
                ticket.settled()
                log.warning("pull from %s failed (%r); retrying", lane.queue, e)
                await asyncio.sleep(0.5)
                continue
            finally:
                self._in_flight -= 1
            if message is None:
                ticket.settled()
                self.lanes.found_empty(lane)
                continue
            await self._delivered(message, ticket.settled, ticket.admitted)

    async def _queue(self, index: int, lane: Lane) -> AbstractQueue:
        key = (index, lane.queue)
        queue = self._queues.get(key)
        if queue is None:
            channel = self.channels[index]
            queue = self._queues[key] = await channel.get_queue(lane.queue, ensure=False)
        return queue
