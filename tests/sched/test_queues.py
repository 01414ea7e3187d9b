"""Waiting queues: FCFS order with preempted requests in front; priority by
(priority, arrival, id) with preempted requests back in their place."""

from __future__ import annotations

import pytest

from blockserve.config import SCHEDULING_POLICIES, SchedulerConfig
from blockserve.errors import InvalidConfigError
from blockserve.sched.lpm import LpmQueue
from blockserve.sched.queues import FcfsQueue, PriorityQueue, create_request_queue
from blockserve.sched.request import Request
from tests.core.helpers import make_manager


def make_request(request_id: str, priority: int = 0, arrival: float = 0.0) -> Request:
    request = Request(request_id, [1, 2, 3], priority=priority)
    request.arrival_time = arrival
    return request


def ids(queue: FcfsQueue | PriorityQueue) -> list[object]:
    return [r.request_id for r in queue]


def test_fcfs_is_arrival_order_and_prepend_goes_first() -> None:
    """add appends, prepend (a preempted request) jumps to the front, pop takes the front."""
    queue = FcfsQueue()
    a, b, c = (make_request(x) for x in "abc")
    queue.add(a)
    queue.add(b)
    queue.prepend(c)
    assert (ids(queue), queue.peek().request_id, len(queue)) == (["c", "a", "b"], "c", 3)
    queue.remove(a)
    assert [queue.pop().request_id, queue.pop().request_id] == ["c", "b"]
    assert len(queue) == 0


def test_priority_orders_by_priority_then_arrival_then_id() -> None:
    """Lower priority first; ties go to the earlier arrival, then to the smaller id."""
    queue = PriorityQueue()
    for request in (
        make_request("late", 1, arrival=5.0),
        make_request("urgent", 0, arrival=9.0),
        make_request("b", 1, arrival=1.0),
        make_request("a", 1, arrival=1.0),
    ):
        queue.add(request)
    assert ids(queue) == ["urgent", "a", "b", "late"]
    queue.remove(next(r for r in queue if r.request_id == "a"))
    assert [queue.pop().request_id for _ in range(3)] == ["urgent", "b", "late"]


def test_a_preempted_request_keeps_its_priority_place() -> None:
    """prepend under priority re-inserts by the request's own key, not at the very front."""
    queue = PriorityQueue()
    queue.add(make_request("first", 0, arrival=1.0))
    queue.prepend(make_request("preempted", 2, arrival=0.5))
    assert ids(queue) == ["first", "preempted"]


def test_unknown_policy_is_a_config_error() -> None:
    """Only fcfs, priority and lpm exist."""
    manager = make_manager()
    queues = [
        create_request_queue(SchedulerConfig(scheduling_policy=p), manager)
        for p in SCHEDULING_POLICIES
    ]
    assert [type(q) for q in queues] == [FcfsQueue, PriorityQueue, LpmQueue]
    with pytest.raises(InvalidConfigError, match="unknown scheduling policy 'lifo'"):
        create_request_queue(SchedulerConfig(scheduling_policy="lifo"), manager)
