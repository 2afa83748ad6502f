"""Fair mode's lanes: one queue per client, and how much of the worker's window each gets.

Producers publish exactly as contract v1 says, to the one request queue. RabbitMQ cannot
route by client (the routing key is the queue's name; the client is in the body or the
AMQP app_id), and a worker that takes only what it can place cannot see client B's
request behind client A's backlog in one FIFO queue. So in fair mode each worker's
router (`worker.serving.router`) moves every message from the request queue into its
client's lane, `<queue>.client.<name>` (a quorum queue like the request queue), with a
confirmed publish before the original is acked; and the intake consumes the lanes. A
backlog waits in its lane, in RabbitMQ, never unacked in a worker.

The lanes are the configured clients (`--client-weights`) plus `other`, which the
unlisted clients share. The worker's window (the messages it may hold unsettled) is
shared between the lanes in credits, one message each (`Lanes.share`, the policy; the
intake, `worker.serving.lane_intake`, is the mechanism): every lane keeps at least one,
so a newcomer's first request is delivered at once; a lane that uses all of its credits
asks for twice as many; one with credits to spare gives them back once they have gone
unused for a while; no lane has more than a one-queue worker's window (`max_num_seqs +
lookahead`), and the whole window is split by weight, max-min fair. Inside the worker the
engine's fair policy then chooses between what the clients have waiting, by service
received. `Lanes` also keeps the prompt tokens waiting in the worker per client
(admission control: a client over its queued-token limit gets no credits until they
shrink).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from broker.messages import DEFAULT_CLIENT

OTHER = "other"  # the lane (and metric label) of every client not configured by name
RECLAIM_S = 1.0  # a lane's spare credits go back to the window after this long unused


@dataclass
class Lane:
    client: str
    queue: str
    weight: float
    spare_since: float | None = None  # since when some of its credits have gone unused
    peak_used: int = 0  # the most of its credits in use at once since then


class Lanes:
    """The lanes of one request queue, and the policy that shares the window among them."""

    def __init__(
        self,
        queue: str,
        weights: Mapping[str, float],
        *,
        max_queued_tokens: int | None = None,
        lane_window: int | None = None,
        reclaim_s: float = RECLAIM_S,
    ) -> None:
        self.queue = queue
        self.max_queued_tokens = max_queued_tokens
        self.lane_window = lane_window  # most credits of one lane
        self.reclaim_s = reclaim_s
        names = [*weights, OTHER] if OTHER not in weights else list(weights)
        self.lanes = {c: Lane(c, lane_queue(queue, c), weights.get(c, 1.0)) for c in names}
        self.queued_tokens: dict[str, int] = defaultdict(int)

    def lane_of(self, client: str) -> Lane:
        """The lane a client's requests go to (unlisted clients share `other`)."""
        return self.lanes.get(client) or self.lanes[OTHER]

    @property
    def queues(self) -> Iterable[str]:
        return (lane.queue for lane in self.lanes.values())

    def share(
        self,
        total: int,
        credits: Mapping[str, int],
        used: Mapping[str, int],
        now: float,
    ) -> dict[str, int]:
        """Credits per lane (client -> count), `total` at most, from each lane's
        `credits` now and how many of them hold a message (`used`).

        What a lane asks for: none while over its queued-token limit; twice its credits
        when all are in use, up to `lane_window` (a backlog is reached in a few steps, a
        trickle does not grab the window, and one client alone leaves the other lanes
        their look-ahead: a newcomer gets it at once, not only as the backlog's requests
        end); what it has while some go unused, until some have gone unused for
        `reclaim_s`, then the most it used at once meanwhile. Each lane not over its
        limit gets one credit first; the rest of `total` goes by weight, max-min fair (no
        lane more than it asks; what one does not ask for goes to the others in
        proportion to weight)."""
        demand: dict[str, int] = {}
        for client, lane in self.lanes.items():
            have, busy = credits.get(client, 0), used.get(client, 0)
            limit = self.max_queued_tokens
            if limit is not None and self.queued_tokens[client] >= limit:
                demand[client] = 0
                lane.spare_since = None
            elif busy >= have:
                demand[client] = max(2 * have, 1)
                if self.lane_window is not None:
                    demand[client] = min(demand[client], self.lane_window)
                lane.spare_since = None
            elif lane.spare_since is None:
                demand[client] = have
                lane.spare_since, lane.peak_used = now, busy
            elif now - lane.spare_since >= self.reclaim_s:
                # What it used at most meanwhile (a snapshot taken just after requests
                # ended would give back credits about to be used again).
                demand[client] = max(lane.peak_used, busy, 1)
                lane.spare_since, lane.peak_used = now, busy  # the next waits as long
            else:
                demand[client] = have
                lane.peak_used = max(lane.peak_used, busy)
        weights = {c: lane.weight for c, lane in self.lanes.items()}
        return water_fill(total, demand, weights)

    def queue_tokens(self, client: str, tokens: int) -> None:
        """`tokens` prompt tokens of `client` wait here (negative: they left)."""
        self.queued_tokens[self.lane_of(client).client] += tokens


def water_fill(
    total: int, demand: Mapping[str, int], weights: Mapping[str, float]
) -> dict[str, int]:
    """Share `total` units: one to each client that asks for any (in order, while they
    last), the rest by weight, max-min fair, no client beyond its demand."""
    give = {c: 0 for c in demand}
    left = total
    for c, d in demand.items():
        if d > 0 and left > 0:
            give[c], left = 1, left - 1
    wanting = {c for c, d in demand.items() if d > give[c]}
    while left > 0 and wanting:
        weight = sum(weights[c] for c in wanting)
        quota = {c: left * weights[c] / weight for c in wanting}
        sated = {c for c in wanting if demand[c] - give[c] <= quota[c]}
        if sated:
            for c in sated:
                left -= demand[c] - give[c]
                give[c] = demand[c]
            wanting -= sated
            continue
        # Every client still wants more than its quota: whole units by quota, then the
        # remaining few to the largest fractions (ties by name: the same every time).
        for c in wanting:
            whole = int(quota[c])
            give[c] += whole
            left -= whole
        by_fraction = sorted(wanting, key=lambda c: (int(quota[c]) - quota[c], c))
        for c in by_fraction[:left]:
            give[c] += 1
        left = 0
    return give


def lane_queue(queue: str, client: str) -> str:
    return f"{queue}.client.{client}"


def metric_label(client: str, named: Iterable[str]) -> str:
    """A client as a metric label: its name if configured (or the default client), else
    `other`, so the label's values stay few."""
    return client if client == DEFAULT_CLIENT or client in set(named) else OTHER
