"""The delivery path of one worker, assembled: settlement, delivery, and how messages are taken.

One queue (`QueueIntake`), or in fair mode (engine policy 'fair') the router into the
clients' lanes and the intake that takes from them in fair order (`LaneIntake`). The
service starts the result and stops it; nothing here runs on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from aio_pika.abc import AbstractChannel, AbstractConnection

from broker.acks import Acker
from broker.publisher import ReplyPublisher, Requeuer
from broker.topology import Topology
from worker.builder import RequestBuilder
from worker.config import EngineConfig, ServiceConfig
from worker.engine.async_engine import EngineFront
from worker.ledger import LedgerStore
from worker.metrics import Metrics
from worker.serving.delivery import Delivery
from worker.serving.drain import DrainState
from worker.serving.intake import FlowControl, Intake, QueueIntake
from worker.serving.isolation import Isolation
from worker.serving.lane_intake import LaneIntake
from worker.serving.lanes import Lanes
from worker.serving.replies import Replier
from worker.serving.router import Router
from worker.serving.settlement import Settlement

ROUTER_WINDOW = 256  # messages a worker's router moves at once (fair mode; 64 ran ~10% slower)


@dataclass(frozen=True)
class Wiring:
    """What the delivery path is built from."""

    connection: AbstractConnection
    consume: AbstractChannel  # the request queue's consumer (one queue)
    publish: AbstractChannel  # with publisher confirms: replies, requeues, lanes
    queue: str
    topology: Topology
    engine: EngineFront
    ledger: LedgerStore
    metrics: Metrics
    drain: DrainState
    engine_config: EngineConfig
    config: ServiceConfig
    worker_id: str


@dataclass
class Serving:
    """The parts a delivery meets, in order; the service starts and stops them."""

    replier: Replier
    settlement: Settlement
    delivery: Delivery
    intake: Intake
    acker: Acker
    lanes: Lanes | None = None
    router: Router | None = None

    async def stop_routing(self) -> None:
        """Stop moving messages into the lanes (a drain begins)."""
        if self.router is not None:
            await self.router.stop()


async def wire(w: Wiring) -> Serving:
    cfg, engine = w.config, w.engine
    lanes = _lanes(w)
    replier = Replier(ReplyPublisher(w.publish))
    acker = Acker()  # acks in runs: one frame for many (broker/acks.py)
    settlement = Settlement(
        w.ledger,
        replier,
        w.metrics,
        delivery_limit=cfg.delivery_limit,
        requeuer=Requeuer(w.publish, w.queue),
        acks=acker,
    )
    delivery = Delivery(
        engine=engine,
        builder=RequestBuilder(engine.tokenizer, engine.limits),
        ledger=w.ledger,
        replier=replier,
        settlement=settlement,
        drain=w.drain,
        metrics=w.metrics,
        worker_id=w.worker_id,
        default_max_tokens=cfg.default_max_tokens,
        max_message_bytes=cfg.max_message_bytes,
        max_request_s=cfg.max_request_s,
        max_queue_delay_s=cfg.max_queue_delay_s,
        isolation=Isolation(),
        lanes=lanes,
    )
    max_seqs = w.engine_config.max_num_seqs
    timing = {"poll_max_s": cfg.poll_max_s, "burst": cfg.burst}
    if lanes is None:
        window = max_seqs + cfg.lookahead
        await w.consume.set_qos(prefetch_count=window)  # the consumer's window
        # Declared (passively), not merely named: a robust channel restores the consumers
        # of the queues it declared after a reconnect, and only those.
        queue = await w.consume.declare_queue(w.queue, passive=True)
        flow = FlowControl(window, cfg.reserve_blocks)
        parts = (engine, flow, w.drain, settlement, w.metrics, delivery.handle)
        return Serving(replier, settlement, delivery, QueueIntake(queue, *parts, **timing), acker)
    # Fair mode: the window has a look-ahead per lane, shared out in credits
    # (worker/serving/lanes.py).
    flow = FlowControl(max_seqs + cfg.lookahead * len(lanes.lanes), cfg.reserve_blocks)
    parts = (engine, flow, w.drain, settlement, w.metrics, delivery.handle)
    route = await w.connection.channel(publisher_confirms=False)
    await route.set_qos(prefetch_count=ROUTER_WINDOW)
    source = await route.declare_queue(w.queue, passive=True)  # restored after a reconnect
    router = Router(source, w.publish, w.topology, lanes, w.metrics)
    await router.start()
    lane_channel = await w.connection.channel(publisher_confirms=False)
    await lane_channel.set_qos(prefetch_count=1)  # per consumer: one credit, one message
    intake = LaneIntake(
        lane_channel,
        lanes,
        *parts,
        poll_max_s=cfg.poll_max_s,
        burst=cfg.burst,
        upstream_drained=router.drained,
    )
    return Serving(replier, settlement, delivery, intake, acker, lanes, router)


def _lanes(w: Wiring) -> Lanes | None:
    """Fair mode (engine policy 'fair'): the clients' lanes; else None (one queue)."""
    if w.engine_config.policy != "fair":
        return None
    return Lanes(
        w.config.queue,
        dict(w.engine_config.client_weights),
        max_queued_tokens=w.config.client_max_queued_tokens,
        lane_window=w.engine_config.max_num_seqs + w.config.lookahead,
    )
