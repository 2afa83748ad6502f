"""Fair mode's router in burst mode: when is nothing left upstream of the lanes
(`Router.drained`)? The routing itself (a confirmed copy into the lane, then the ack)
is replaced by a gate the test holds; the broker side runs in tests/integration."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.topology import Topology
from worker.metrics import Metrics
from worker.serving.lanes import Lanes
from worker.serving.router import Router


class FakeSource:
    """The request queue: `get` takes the oldest message (basic.get), `deliver` pushes
    one to the consumer as the broker would."""

    def __init__(self, n: int) -> None:
        self.messages = [f"m{i}" for i in range(n)]
        self.gets = 0
        self.consumer: Any = None

    async def get(self, **_: Any) -> str | None:
        self.gets += 1
        return self.messages.pop(0) if self.messages else None

    async def consume(self, callback: Any, no_ack: bool = False) -> str:
        self.consumer = callback
        return "router"

    async def cancel(self, tag: str) -> None:
        self.consumer = None


class FakePublish:
    publisher_confirms = True

    async def declare_queue(self, name: str, **_: Any) -> None:
        return None


async def gated_router(source: FakeSource) -> tuple[Router, list[str], asyncio.Event]:
    """A started router whose routing of each message waits for the returned gate."""
    router = Router(
        source,  # type: ignore[arg-type]
        FakePublish(),  # type: ignore[arg-type]
        Topology(queue="q"),
        Lanes("q", {"a": 1.0}),
        Metrics("w", "m"),
    )
    await router.start()
    routed: list[str] = []
    gate = asyncio.Event()

    async def route_one(message: Any) -> None:
        await gate.wait()
        routed.append(message)

    router._route_one = route_one  # type: ignore[method-assign]
    return router, routed, gate


async def settle_down(turns: int = 20) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_drained_only_after_two_quiet_looks_with_nothing_on_its_way() -> None:
    source = FakeSource(2)
    router, routed, gate = await gated_router(source)
    assert not await router.drained()  # took m0: routed in a task of its own
    await settle_down()
    assert not await router.drained()  # m0 still on its way into its lane
    assert source.gets == 1
    gate.set()
    await settle_down()
    assert not await router.drained()  # took m1
    await settle_down()
    assert routed == ["m0", "m1"]
    assert not await router.drained()  # the first empty look
    assert await router.drained()  # the second, nothing taken in between

    # A delivery pushed to the consumer after an empty look: the next look, empty too,
    # does not count as the second quiet one.
    await source.consumer("m2")
    assert routed == ["m0", "m1", "m2"]
    assert not await router.drained()
    assert await router.drained()


async def test_a_stopped_router_takes_nothing_more() -> None:
    source = FakeSource(3)
    router, routed, gate = await gated_router(source)
    gate.set()
    await router.stop()
    assert await router.drained()
    assert source.gets == 0 and routed == [] and len(source.messages) == 3
