"""The scheduling policy, as one object: the order of the waiting queue, and who gives way.

`create_request_queue(policy)` makes the scheduler's waiting queue (vLLM v1's
request_queue.py); the scheduler only calls this interface, never asks which policy it has.

  "fcfs"      first come first served: a deque. A preempted request goes back to the front;
              the running request preempted when blocks run out is the last admitted.
  "priority"  lower `priority` first, ties by arrival: a heap on `Request.sort_key`, which is
              (priority, arrival_time, admission order). A preempted request simply rejoins
              the heap at its place; the victim is the running request with the largest key
              (the least important, and among equals the latest to arrive).

The queue never looks at blocks or budgets, and never changes a request.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from jaxllm.engine.request import Request
from jaxllm.scheduling_policy import SCHEDULING_POLICIES


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        """A preempted request: it resumes before everyone who was waiting."""
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        """The running request to preempt when blocks run out: the tail (the newest)."""
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """In the order they will be scheduled."""
        return iter(self._queue)


class PriorityRequestQueue:
    def __init__(self) -> None:
        # (sort_key, request); sort keys are unique (they end in the admission order), so the
        # request itself is never compared.
        self._heap: list[tuple[tuple, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, request))

    # Nothing jumps the queue here: a preempted request keeps its priority and arrival.
    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request: Request) -> None:
        # O(n), as vLLM's: only aborts and stop strings of waiting requests come here.
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        """The running request with the largest (priority, arrival): the least important."""
        return max(running, key=lambda r: r.sort_key)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In the order they will be scheduled."""
        return iter([request for _, request in sorted(self._heap, key=lambda e: e[0])])


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
