"""The router's own bookkeeping (cluster/router.py), driven in each order Ray Serve calls it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from blockserve.cluster.policies import KVAwarePolicy
from blockserve.cluster.router import PolicyRouter
from blockserve.engine.request import RequestSpec

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="blockserve")
PROMPT = tuple(range(12))  # 3 full blocks of 4


@dataclass
class Replica:
    """What `PolicyRouter` reads of Serve's `RunningReplica` (which needs a live actor)."""

    replica_id: ReplicaID


def replica(name: str) -> Replica:
    return Replica(ReplicaID(name, DEPLOYMENT))


def kv_router() -> PolicyRouter:
    router = PolicyRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="kv", block_size=4)
    return router


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Serve's router loop: a pending request's future belongs to one."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pending(loop: asyncio.AbstractEventLoop, request_id: str) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    spec = RequestSpec(request_id, PROMPT)
    return PendingRequest([spec], {}, metadata, future=loop.create_future())


def choose(
    loop: asyncio.AbstractEventLoop, router: PolicyRouter, request: PendingRequest, *replicas: Any
) -> str:
    ranked = loop.run_until_complete(router.choose_replicas(list(replicas), request))
    return ranked[0][0].replica_id.unique_id


def queued(router: PolicyRouter) -> dict[str, int]:
    assert isinstance(router.policy, KVAwarePolicy)
    return router.policy.queued


def test_a_request_queues_its_blocks_on_its_replica_until_it_ends(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Routed then completed, as Serve reports a request that outlives its routing."""
    router, a = kv_router(), replica("a")
    request = pending(loop, "r1")
    assert choose(loop, router, request, a) == "a"
    router.on_request_routed(request, a.replica_id, None)
    assert (router.in_flight.count("a"), queued(router)) == (1, {"a": 3})
    router.on_request_completed(a.replica_id, "r1")
    assert (router.in_flight.count("a"), queued(router)) == (0, {"a": 0})


def test_a_request_that_ends_before_it_is_reported_routed_leaves_nothing_queued(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Serve can report a short request's end before its routing: it is credited to its
    replica, and neither in flight nor queued there."""
    router, a, b = kv_router(), replica("a"), replica("b")
    request = pending(loop, "r1")
    assert choose(loop, router, request, a) == "a"
    router.on_request_completed(a.replica_id, "r1")
    router.on_request_routed(request, a.replica_id, None)
    assert (router.in_flight.count("a"), queued(router)) == (0, {"a": 0})
    # Its blocks were credited to "a": the same prompt goes there again, over an empty "b".
    assert choose(loop, router, pending(loop, "r2"), b, a) == "a"


def test_a_refused_attempt_ending_late_leaves_the_request_queued_elsewhere(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Serve cancels an attempt a full replica refused and routes the request again: the
    first attempt's end, reported after the second was routed, ends nothing."""
    router, a, b = kv_router(), replica("a"), replica("b")
    request = pending(loop, "r1")
    choose(loop, router, request, a, b)
    router.on_request_routed(request, b.replica_id, None)
    router.on_request_completed(a.replica_id, "r1")
    assert (router.in_flight.count("b"), queued(router)) == (1, {"b": 3})
    router.on_request_completed(b.replica_id, "r1")
    assert (router.in_flight.count("b"), queued(router)) == (0, {"b": 0})
