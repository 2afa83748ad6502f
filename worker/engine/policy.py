"""Scheduling policies: who waits in front, and who is preempted first.

Policy is kept apart from the mechanism (the scheduler and the KV cache): a policy
orders the waiting queue and picks the preemption victim, nothing else.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from worker.request import Request


class Policy(Protocol):
    def add(self, req: Request) -> None:
        """Queue a new request."""

    def requeue(self, req: Request) -> None:
        """Put back a preempted request (it resumes before newer work of its rank)."""

    def peek(self) -> Request | None: ...

    def pop(self) -> Request: ...

    def remove(self, req: Request) -> bool: ...

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""

    def served(self, req: Request, prefill_tokens: int, decode_tokens: int) -> None:
        """The tokens computed for `req` in a step (for policies that share by service)."""

    def left(self, req: Request) -> None:
        """`req` left the running batch (finished or preempted)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSPolicy:
    """First come, first served; the newest running request is preempted first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def requeue(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._queue.remove(req)
        except ValueError:
            return False
        return True

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.arrival_time, r.seq))

    def served(self, req: Request, prefill_tokens: int, decode_tokens: int) -> None:
        pass

    def left(self, req: Request) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityPolicy:
    """Lower priority value first, FCFS among equals, with aging.

    Aging: waiting `aging_s` seconds is worth one priority level. Since every waiting
    request ages at the same rate, the order never changes while they wait, so the
    effective key is static: priority * aging_s + arrival_time (a request of priority p
    queues as if it had arrived p * aging_s seconds later). Without aging the key is
    (priority, arrival_time) and low priority work waits for all high priority work.
    """

    def __init__(self, aging_s: float = 0.0) -> None:
        self.aging_s = aging_s
        self._heap: list[tuple[tuple[float, float, int], int, Request]] = []
        self._removed: set[int] = set()  # id() of requests removed but still in the heap
        self._len = 0

    def key(self, req: Request) -> tuple[float, float, int]:
        if self.aging_s > 0:
            return (req.priority * self.aging_s + req.arrival_time, 0.0, req.seq)
        return (float(req.priority), req.arrival_time, req.seq)

    def add(self, req: Request) -> None:
        self._removed.discard(id(req))
        heapq.heappush(self._heap, (self.key(req), req.seq, req))
        self._len += 1

    # The key (with the request's original sequence number) already puts a preempted
    # request back where it belongs: before newer work of its rank.
    requeue = add

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][2]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[2]))

    def peek(self) -> Request | None:
        self._prune()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._prune()
        self._len -= 1
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> bool:
        if id(req) in self._removed or not any(e[2] is req for e in self._heap):
            return False
        self._removed.add(id(req))
        self._len -= 1
        return True

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.key)

    def served(self, req: Request, prefill_tokens: int, decode_tokens: int) -> None:
        pass

    def left(self, req: Request) -> None:
        pass

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap) if id(e[2]) not in self._removed)
