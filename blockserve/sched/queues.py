"""Waiting-request queues: FCFS (a deque), priority (a heap) and lpm (sched/lpm.py).

Priority order is `(priority, arrival_time, request_id)`, lower first. A preempted request
goes back to the front: under FCFS and lpm literally, under priority by its (old) key.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from blockserve.config import SchedulerConfig
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.errors import InvalidConfigError
from blockserve.sched.lpm import LpmQueue
from blockserve.sched.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None:
        """Enqueue a new request at its place in the order."""

    def prepend(self, request: Request) -> None:
        """Put a preempted request back at the front (of its priority class)."""

    def peek(self) -> Request:
        """The next request to admit; IndexError when empty."""

    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    def remove(self, request: Request) -> None:
        """Take out a request anywhere in the queue (an abort)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    """First come, first served; preempted requests jump back to the head."""

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

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float, Any]:
    """Lower is served first: priority, then arrival, then id (a total order)."""
    return (request.priority, request.arrival_time, request.request_id)


class PriorityQueue:
    """A heap on `priority_key`."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, Any], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    prepend = add  # a preempted request keeps its key, which puts it where it belongs

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


def create_request_queue(config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> RequestQueue:
    """The waiting queue for `config.scheduling_policy`; an lpm queue listens to the
    manager's pool."""
    if config.scheduling_policy == "fcfs":
        return FcfsQueue()
    if config.scheduling_policy == "priority":
        return PriorityQueue()
    if config.scheduling_policy == "lpm":
        pool = kv_cache_manager.block_pool
        queue = LpmQueue(
            is_cached=pool.cached_block_hash_to_block.__contains__,
            block_size=pool.block_size,
            max_model_len=config.max_model_len,
            aging_s=config.lpm_aging_s,
        )
        pool.add_listener(queue)
        return queue
    raise InvalidConfigError(f"unknown scheduling policy {config.scheduling_policy!r}")
