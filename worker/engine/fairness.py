"""Fair share between clients by service received: the Virtual Token Counter policy.

Each client (the producer service a request is accounted to) has a counter of the
service it received: the tokens the engine computed for it, prefill tokens weighing 1
(charged when the request is admitted) and decode tokens 2 (as they are generated),
VTC's defaults, divided by the client's weight. When a sequence
slot frees, the waiting client with the lowest counter is admitted first; within a
client, requests keep their order (priority with aging, then arrival), and deadlines
work as before. A client that had nothing waiting or running has its counter lifted to
the lowest counter among the clients that have, so idle time is not banked as credit.
The policy is work-conserving: a client alone gets every slot.

Reference: Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024).
Optionally a client may hold at most `max_running` sequences at once (admission
control); its other requests wait.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence

from worker.engine.policy import PriorityPolicy
from worker.request import Request, RequestStatus

PREFILL_WEIGHT = 1.0
DECODE_WEIGHT = 2.0


class FairPolicy:
    """Virtual Token Counter across clients; priority with aging within a client."""

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        aging_s: float = 0.0,
        max_running: int | None = None,
    ) -> None:
        self.weights = dict(weights or {})
        self.aging_s = aging_s
        self.max_running = max_running
        self.counters: dict[str, float] = defaultdict(float)
        self._queues: dict[str, PriorityPolicy] = {}
        self._running: dict[str, int] = defaultdict(int)

    def weight(self, client: str) -> float:
        return self.weights.get(client, 1.0)

    # -- the waiting queue ------------------------------------------------------------------

    def add(self, req: Request) -> None:
        queue = self._queue(req.client)
        if not queue and not self._running[req.client]:
            # Newly active: no credit for the time it had nothing here. Its counter
            # starts from the lowest among the clients with work waiting or running.
            active = [
                self.counters[c]
                for c in self._queues
                if c != req.client and (self._queues[c] or self._running[c])
            ]
            if active:
                self.counters[req.client] = max(self.counters[req.client], min(active))
        queue.add(req)

    def requeue(self, req: Request) -> None:
        self._queue(req.client).requeue(req)

    def peek(self) -> Request | None:
        client = self._next_client()
        return None if client is None else self._queues[client].peek()

    def pop(self) -> Request:
        """Admit the head of the least-served client, charging its prompt at once: the
        slots of one step are shared by counters that already count this admission."""
        client = self._next_client()
        assert client is not None, "pop from an empty policy"
        self._running[client] += 1
        req = self._queues[client].pop()
        if req.status == RequestStatus.WAITING:  # a first admission, not a resumption
            cost = PREFILL_WEIGHT * req.num_prompt_tokens
            self.counters[client] += cost / self.weight(client)
        return req

    def remove(self, req: Request) -> bool:
        queue = self._queues.get(req.client)
        return queue is not None and queue.remove(req)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    # -- what the scheduler reports -------------------------------------------------------------

    def served(self, req: Request, prefill_tokens: int, decode_tokens: int) -> None:
        """Charge the tokens generated for `req` this step to its client (its prompt was
        charged when it was admitted; recomputing it after a preemption is not the
        client's doing and is not charged)."""
        self.counters[req.client] += DECODE_WEIGHT * decode_tokens / self.weight(req.client)

    def left(self, req: Request) -> None:
        """`req` left the running batch (finished or preempted)."""
        self._running[req.client] -= 1

    def victim(self, running: Sequence[Request]) -> Request:
        """Preempt from the client that received the most service; within it, the
        request its own order puts last."""
        client = max({r.client for r in running}, key=lambda c: self.counters[c])
        mine = [r for r in running if r.client == client]
        return max(mine, key=self._queue(client).key)

    # -- internals ------------------------------------------------------------------------------

    def _queue(self, client: str) -> PriorityPolicy:
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = PriorityPolicy(self.aging_s)
        return queue

    def _next_client(self) -> str | None:
        """The waiting client with the lowest counter (ties: the one running fewer,
        then the earlier head), skipping clients at their running cap."""
        best: tuple[float, int, float, int] | None = None
        chosen = None
        for client, queue in self._queues.items():
            head = queue.peek()
            if head is None:
                continue
            running = self._running[client]
            if self.max_running is not None and running >= self.max_running:
                continue
            key = (self.counters[client], running, head.arrival_time, head.seq)
            if best is None or key < best:
                best, chosen = key, client
        return chosen
