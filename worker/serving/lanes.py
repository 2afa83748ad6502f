"""Fair mode's lanes: one queue per client, and which lane a worker takes from next.

Producers publish exactly as contract v1 says, to the one request queue. RabbitMQ cannot
route by client (the routing key is the queue's name; the client is in the body or the
AMQP app_id), and a worker that pulls only what it can place cannot see client B's
request behind client A's backlog in one FIFO queue. So in fair mode each worker's
router (`worker.serving.router`) moves every message from the request queue into its
client's lane, `<queue>.client.<name>` (a quorum queue like the request queue), with a
confirmed publish before the original is acked; and the intake takes from the lanes in
fair order. A backlog waits in its lane, in RabbitMQ, never unacked in a worker.

The lanes are the configured clients (`--client-weights`) plus `other`, which the
unlisted clients share. `Lanes` also keeps, per client, what this worker holds and the
prompt tokens waiting in it (admission control: a client over its queued-token limit is
not taken from until they shrink).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from broker.messages import DEFAULT_CLIENT

OTHER = "other"  # the lane (and metric label) of every client not configured by name


@dataclass
class Lane:
    client: str
    queue: str
    weight: float
    empty_until: float = 0.0  # believed empty until then (monotonic seconds)
    empty_backoff: float = 0.0


class Lanes:
    """The lanes of one request queue, and this worker's holdings per client."""

    def __init__(
        self,
        queue: str,
        weights: Mapping[str, float],
        *,
        max_queued_tokens: int | None = None,
        poll_max_s: float = 0.05,
    ) -> None:
        self.queue = queue
        self.max_queued_tokens = max_queued_tokens
        self.poll_max_s = poll_max_s
        names = [*weights, OTHER] if OTHER not in weights else list(weights)
        self.lanes = {c: Lane(c, lane_queue(queue, c), weights.get(c, 1.0)) for c in names}
        self.held: dict[str, int] = defaultdict(int)
        self.queued_tokens: dict[str, int] = defaultdict(int)

    def lane_of(self, client: str) -> Lane:
        """The lane a client's requests go to (unlisted clients share `other`)."""
        return self.lanes.get(client) or self.lanes[OTHER]

    @property
    def queues(self) -> Iterable[str]:
        return (lane.queue for lane in self.lanes.values())

    # -- the intake's choice ------------------------------------------------------------------

    def next_lane(self, now: float | None = None) -> Lane | None:
        """The lane to take from next: among lanes not believed empty and not over their
        queued-token limit, the one whose client holds the least here for its weight."""
        now = time.monotonic() if now is None else now
        best: tuple[float, float] | None = None
        chosen = None
        for lane in self.lanes.values():
            if lane.empty_until > now:
                continue
            limit = self.max_queued_tokens
            if limit is not None and self.queued_tokens[lane.client] >= limit:
                continue
            key = (self.held[lane.client] / lane.weight, lane.empty_until)
            if best is None or key < best:
                best, chosen = key, lane
        return chosen

    def found_empty(self, lane: Lane, now: float | None = None) -> None:
        """A get found the lane empty: look again after a growing pause."""
        now = time.monotonic() if now is None else now
        lane.empty_backoff = min(max(lane.empty_backoff * 2, 0.002), self.poll_max_s)
        lane.empty_until = now + lane.empty_backoff

    def has_messages(self, client: str) -> None:
        """Something was just routed into this client's lane: look at once."""
        lane = self.lane_of(client)
        lane.empty_until = 0.0
        lane.empty_backoff = 0.0

    @property
    def all_empty(self) -> bool:
        now = time.monotonic()
        return all(lane.empty_until > now for lane in self.lanes.values())

    # -- holdings ------------------------------------------------------------------------------

    def took(self, client: str) -> None:
        self.held[self.lane_of(client).client] += 1

    def settled(self, client: str) -> None:
        self.held[self.lane_of(client).client] -= 1

    def queue_tokens(self, client: str, tokens: int) -> None:
        """`tokens` prompt tokens of `client` wait here (negative: they left)."""
        self.queued_tokens[self.lane_of(client).client] += tokens


def lane_queue(queue: str, client: str) -> str:
    return f"{queue}.client.{client}"


def metric_label(client: str, named: Iterable[str]) -> str:
    """A client as a metric label: its name if configured (or the default client), else
    `other`, so the label's values stay few."""
    return client if client == DEFAULT_CLIENT or client in set(named) else OTHER
