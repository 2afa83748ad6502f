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
unlisted clients share. The intake keeps up to `lookahead` requests of every client
with work waiting in the engine (so the engine's fair policy chooses between clients at
every free slot, not between whatever one client's burst brought), taking first from
the lane whose client received the least service for its weight (the engine's Virtual
Token Counter rule, fed with the tokens each step computes).
`Lanes` also keeps, per client, what this worker holds and the prompt tokens waiting in
it (admission control: a client over its queued-token limit is not taken from until
they shrink).
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
        lookahead: int = 2,
        poll_max_s: float = 0.05,
    ) -> None:
        self.queue = queue
        self.max_queued_tokens = max_queued_tokens
        self.lookahead = lookahead
        self.poll_max_s = poll_max_s
        names = [*weights, OTHER] if OTHER not in weights else list(weights)
        self.lanes = {c: Lane(c, lane_queue(queue, c), weights.get(c, 1.0)) for c in names}
        self.held: dict[str, int] = defaultdict(int)
        self.queued_tokens: dict[str, int] = defaultdict(int)
        # Per lane: taken (or being taken) and not yet in the engine, and waiting in the
        # engine's queue as of its last step: what "waits here to start".
        self.on_the_way: dict[str, int] = defaultdict(int)
        self.engine_waiting: dict[str, int] = {}
        # Service received per lane, over its weight (the engine's Virtual Token Counter
        # rule, from the tokens each step computed): the intake takes from the lane that
        # received least, as the engine admits the client that received least.
        self.counters: dict[str, float] = defaultdict(float)

    def lane_of(self, client: str) -> Lane:
        """The lane a client's requests go to (unlisted clients share `other`)."""
        return self.lanes.get(client) or self.lanes[OTHER]

    @property
    def queues(self) -> Iterable[str]:
        return (lane.queue for lane in self.lanes.values())

    # -- the intake's choice ------------------------------------------------------------------

    def next_lane(self, now: float | None = None) -> Lane | None:
        """The lane to take from next: among lanes not believed empty, with fewer than
        `lookahead` requests waiting here to start, and not over their queued-token
        limit, the one whose client received the least service for its weight (then:
        holds the least here for its weight)."""
        now = time.monotonic() if now is None else now
        best: tuple[float, float] | None = None
        chosen = None
        for lane in self.lanes.values():
            if lane.empty_until > now:
                continue
            if self.waiting(lane.client) >= self.lookahead:
                continue  # enough of it waits here already: the engine chooses among them
            limit = self.max_queued_tokens
            if limit is not None and self.queued_tokens[lane.client] >= limit:
                continue
            key = (self.counters[lane.client], self.held[lane.client] / lane.weight)
            if best is None or key < best:
                best, chosen = key, lane
        return chosen

    def served(self, client_tokens: Mapping[str, tuple[int, int]]) -> None:
        """Charge one engine step's tokens (prompt, generated) per client: prompt tokens
        weigh 1, generated 2, over the lane's weight."""
        for client, (prompt, generated) in client_tokens.items():
            lane = self.lane_of(client)
            self.counters[lane.client] += (prompt + 2 * generated) / lane.weight

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

    def take(self, lane: Lane) -> Ticket:
        """A message is being taken from `lane`: counted at once (other pullers see it)."""
        client = lane.client
        if not self.held[client]:
            # It had nothing here: no credit for the time it had nothing (as the engine's
            # policy, its counter starts from the lowest of those that have work here).
            busy = [self.counters[c] for c, n in self.held.items() if n and c != client]
            if busy:
                self.counters[client] = max(self.counters[client], min(busy))
        self.held[client] += 1
        self.on_the_way[client] += 1
        return Ticket(self, client)

    def waiting(self, client: str) -> int:
        """Requests of `client`'s lane waiting here to start."""
        return self.on_the_way[client] + self.engine_waiting.get(client, 0)

    def engine_step(self, client_waiting: Mapping[str, int]) -> None:
        """The engine's waiting requests per client after its last step."""
        waiting: dict[str, int] = defaultdict(int)
        for client, n in client_waiting.items():
            waiting[self.lane_of(client).client] += n
        self.engine_waiting = waiting

    def queue_tokens(self, client: str, tokens: int) -> None:
        """`tokens` prompt tokens of `client` wait here (negative: they left)."""
        self.queued_tokens[self.lane_of(client).client] += tokens


class Ticket:
    """One message taken from a lane: on its way to the engine until admitted, held
    until settled (each counted down once)."""

    __slots__ = ("_admitted", "_settled", "client", "lanes")

    def __init__(self, lanes: Lanes, client: str) -> None:
        self.lanes, self.client = lanes, client
        self._admitted = self._settled = False

    def admitted(self) -> None:
        if not self._admitted:
            self._admitted = True
            self.lanes.on_the_way[self.client] -= 1

    def settled(self) -> None:
        self.admitted()
        if not self._settled:
            self._settled = True
            self.lanes.held[self.client] -= 1


def lane_queue(queue: str, client: str) -> str:
    return f"{queue}.client.{client}"


def metric_label(client: str, named: Iterable[str]) -> str:
    """A client as a metric label: its name if configured (or the default client), else
    `other`, so the label's values stay few."""
    return client if client == DEFAULT_CLIENT or client in set(named) else OTHER
