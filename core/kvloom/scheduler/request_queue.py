"""Waiting queues for the two scheduling policies."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from kvloom.request import Request


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_all(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival (``Request.__lt__``).

    A preempted request re-enters at its rank: it is the lowest-priority running request,
    so higher-priority waiting requests may go before it.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_all(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


RequestQueue = FCFSQueue | PriorityQueue


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority'; got {policy!r}")
