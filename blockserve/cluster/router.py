"""Ray Serve request routers running blockserve's policies (cluster/policies.py)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from blockserve.cluster import registry
from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT, KVAwarePolicy, make_policy
from blockserve.cluster.routing import (
    InFlight,
    ReplicaLoad,
    RouteRequest,
    RoutingPolicy,
    route_request,
)
from blockserve.core.hashing import BlockHasher
from blockserve.events.subscriber import KVEventSubscriber, ReplayUnavailableError

logger = logging.getLogger(__name__)

_POLL_MS = 50
_IDLE_S = 0.05
_MAX_UNROUTED = 10_000


class PolicyRouter(FIFOMixin, RequestRouter):
    """A blockserve policy on Ray Serve. `request_router_kwargs`: policy (a name from
    cluster/policies.py), block_size, hash_algo, hash_seed (None: the engines' default),
    lora_paths (the replicas' --lora-modules, name -> path: both enter an adapter's block
    hashes), prefix_weight and max_blocks_per_replica (kv).

    `PolicyRouter` runs any policy on Ray Serve's `RequestRouter` API: it counts each replica's
    requests in flight from this router (its load), asks the policy for a ranking, and tells the
    policy where requests went and when they ended. `KVCacheAwareRouter` adds the replicas' KV
    events: for every replica that advertises an event endpoint (its routing stats), a
    subscriber on one background thread keeps that replica's `PrefixIndex` current — gaps
    replayed, a replica that died dropped at once, a restarted one followed from an empty index.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.block_size: int = kwargs.get("block_size", 16)
        self.hasher = BlockHasher(kwargs.get("hash_algo", "sha256"), kwargs.get("hash_seed"))
        self.lora_paths: dict[str, str] = dict(kwargs.get("lora_paths", {}))
        self.policy: RoutingPolicy = make_policy(
            kwargs.get("policy", "kv"),
            kwargs.get("max_blocks_per_replica", 1 << 20),
            kwargs.get("prefix_weight", DEFAULT_PREFIX_WEIGHT),
        )
        self.lock = threading.Lock()  # the policy's state: this loop and the event thread
        self.in_flight = InFlight(_MAX_UNROUTED)  # by internal request id
        self._routes: dict[str, RouteRequest] = {}  # internal request id -> its route
        self._live: set[str] = set()  # the replicas of the last update
        registry.ROUTERS.add(self)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per replica this router can route to: its requests in flight from here."""
        return {rid: {"in_flight": self.in_flight.count(rid)} for rid in sorted(self._live)}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route = self._route_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [ReplicaLoad(rid, self.in_flight.count(rid)) for rid in by_id]
        with self.lock:
            ranked = self.policy.rank(route, loads, time.monotonic())
        # The best alone first; the rest after, should Serve find it full.
        return [[by_id[ranked[0]]], [by_id[rid] for rid in ranked[1:]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        replica, request_id = replica_id.unique_id, pending_request.metadata.internal_request_id
        counted = self.in_flight.routed(replica, request_id)  # False: it has ended already
        route = self._routes.pop(request_id, None)
        if route is not None:
            with self.lock:
                # The replica holds its blocks either way: credited until its events say so.
                self.policy.on_routed(route, replica, time.monotonic(), request_id)
                if not counted:
                    self.policy.on_finished(request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.ended(replica_id.unique_id, internal_request_id):
            with self.lock:
                self.policy.on_finished(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for replica_id in self._live - live:  # stopped, or replaced by Serve
            self._forget(replica_id)
        self._live = live

    def _forget(self, replica_id: str) -> None:
        self.in_flight.forget(replica_id)
        with self.lock:
            self.policy.forget(replica_id)

    def _route_of(self, pending_request: PendingRequest | None) -> RouteRequest:
        if pending_request is None or not pending_request.args:
            return RouteRequest(())
        request_id = pending_request.metadata.internal_request_id
        route = self._routes.get(request_id)
        if route is None:
            spec = pending_request.args[0]
            route = route_request(spec, self.hasher, self.block_size, self.lora_paths)
            self._routes[request_id] = route
            if len(self._routes) > _MAX_UNROUTED:  # requests cancelled before being routed
                del self._routes[next(iter(self._routes))]
        return route


class KVCacheAwareRouter(PolicyRouter):
    """Exact prefix overlap (from every replica's KV events) against the work queued on each
    replica; see KVAwarePolicy."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**{**kwargs, "policy": "kv"})
        assert isinstance(self.policy, KVAwarePolicy)
        self.kv_policy: KVAwarePolicy = self.policy
        self._subscribers: dict[str, KVEventSubscriber] = {}
        # zmq sockets belong to one thread: the event thread closes those forgotten.
        self._retired: list[KVEventSubscriber] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._follow_events, name="kv-router", daemon=True)
        self._thread.start()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        # Routing stats (the event endpoints) can arrive after the replica itself.
        self._subscribe(candidate_replicas)
        return await super().choose_replicas(candidate_replicas, pending_request)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._subscribe(replicas)

    def report(self) -> dict[str, dict[str, Any]]:
        """Adds, per replica: whether its KV events are followed, its index's size, and the
        blocks of work queued on it."""
        report = super().report()
        with self.lock:
            for replica_id, entry in report.items():
                index = self.kv_policy.index(replica_id)
                entry["kv_events"] = replica_id in self._subscribers
                entry["indexed_blocks"] = index.num_blocks
                entry["credited_blocks"] = index.num_credits
                entry["queued_blocks"] = self.kv_policy.queued.get(replica_id, 0)
        return report

    def _subscribe(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            stats = replica.routing_stats or {}
            endpoint = stats.get("kv_events_endpoint")
            if endpoint is None or replica_id in self._subscribers:
                continue
            subscriber = KVEventSubscriber(endpoint, stats.get("kv_replay_endpoint"))
            with self.lock:
                self._subscribers[replica_id] = subscriber
                # Credits are bounded like the mirror: by what the replica can hold.
                index = self.kv_policy.index(replica_id)
                index.max_credits = stats.get("num_blocks", index.max_credits)
            logger.info("following the KV events of replica %s at %s", replica_id, endpoint)

    def _forget(self, replica_id: str) -> None:
        with self.lock:
            subscriber = self._subscribers.pop(replica_id, None)
            if subscriber is not None:
                self._retired.append(subscriber)
        super()._forget(replica_id)

    def _follow_events(self) -> None:
        """Apply every replica's event batches to its index, in order, until stopped."""
        while not self._stopping.is_set():
            with self.lock:
                subscribers = list(self._subscribers.items())
                retired, self._retired = self._retired, []
            for subscriber in retired:
                subscriber.close()
            if not subscribers:
                time.sleep(_IDLE_S)
            for replica_id, subscriber in subscribers:
                self._poll_one(replica_id, subscriber, _POLL_MS // max(len(subscribers), 1))

    def _poll_one(self, replica_id: str, subscriber: KVEventSubscriber, timeout_ms: int) -> None:
        try:
            batches = subscriber.poll(timeout_ms)
        except ReplayUnavailableError:
            # Batches were lost for good: what the events said may be wrong. Start over empty
            # (an undercount only costs hits) from the batch that revealed the gap; the
            # credits of requests routed there stand (the events never made them).
            logger.warning("KV events of replica %s lost; its index starts over", replica_id)
            with self.lock:
                self.kv_policy.index(replica_id).clear_events()
            return
        if batches:
            with self.lock:
                if replica_id in self._subscribers:
                    self.kv_policy.index(replica_id).apply(batch for _, batch in batches)
