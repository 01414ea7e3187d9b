"""Replaying a trace through N replicas behind a routing policy: the router at scale, simulated.
Each replica is a real `KVCacheManager` whose KV events feed the router's index exactly as a live
replica's ZMQ stream does; the policy is the one the Ray Serve router runs (cluster/policies.py),
not a copy. What is simulated is time, from the trace's timestamps:"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockserve.cluster.policies import KVAwarePolicy
from blockserve.cluster.routing import ReplicaLoad, RouteRequest, RoutingPolicy
from blockserve.core.events import KVEventBatch, KVEventRecorder
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.errors import InvalidConfigError
from blockserve.replay.simulate import ReplayRequest, run_request
from blockserve.replay.trace import BlockLayout, TraceRequest

#     a replica prefills one request at a time, FIFO, at `prefill_tokens_per_s` (cached tokens
#     are free); decoding then takes `output_length / decode_tokens_per_s`, overlapped with
#     other work. A request is in flight (the load a router sees) from arrival to its last token.
#
# TTFT = queueing + prefill. As in the single-cache replay, a request's blocks are allocated and
# freed at once, so what is cached depends only on the policy and the routing.


@dataclass(frozen=True, slots=True)
class ServiceModel:
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 40.0


DEFAULT_SERVICE = ServiceModel()


@dataclass(frozen=True, slots=True)
class ClusterShape:
    num_replicas: int
    capacity_blocks: int  # per replica
    block_size: int  # tokens per block (per trace hash id)

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.capacity_blocks < 1 or self.block_size < 1:
            raise InvalidConfigError("the cluster needs at least one replica of at least one block")


@dataclass(frozen=True, slots=True)
class ClusterReplayResult:
    router: str
    num_replicas: int
    capacity_blocks: int  # per replica
    num_requests: int
    num_skipped: int
    hit_tokens: int
    query_tokens: int
    requests_per_replica: tuple[int, ...]
    computed_tokens_per_replica: tuple[int, ...]  # prompt tokens prefilled (misses)
    ttft_p50_s: float
    ttft_p90_s: float
    route_seconds: float  # in the policy: ranking and bookkeeping, per request summed
    seconds: float

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def load_imbalance(self) -> float:
        """max / mean of the prompt tokens each replica computed (1.0: perfectly even)."""
        mean = statistics.fmean(self.computed_tokens_per_replica)
        return max(self.computed_tokens_per_replica) / mean if mean else 1.0

    @property
    def route_us_per_request(self) -> float:
        routed = self.num_requests - self.num_skipped
        return 1e6 * self.route_seconds / routed if routed else 0.0


@dataclass(slots=True)
class _Replica:
    replica_id: str
    manager: KVCacheManager
    recorder: KVEventRecorder
    finishes: list[tuple[float, str]] = field(default_factory=list)  # heap: (end, request id)
    prefill_free_at: float = 0.0
    num_requests: int = 0
    computed_tokens: int = 0

    def finish_until(self, now: float) -> list[str]:
        """The requests that ended by `now`, taken off the replica."""
        ended = []
        while self.finishes and self.finishes[0][0] <= now:
            ended.append(heapq.heappop(self.finishes)[1])
        return ended


def replay_cluster(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    policy: RoutingPolicy,
    shape: ClusterShape,
    service: ServiceModel = DEFAULT_SERVICE,
) -> ClusterReplayResult:
    """Route every request of `trace` (in timestamp order) to one of the shape's replicas,
    run it there, and feed that pool's events back to the policy. A request needing more
    blocks than one replica has is skipped."""
    capacity = shape.capacity_blocks
    replicas = [
        _new_replica(f"replica-{i}", capacity, shape.block_size) for i in range(shape.num_replicas)
    ]
    by_id = {r.replica_id: r for r in replicas}
    ttfts: list[float] = []
    hit_tokens = query_tokens = num_skipped = 0
    route_seconds = 0.0
    to_external = replicas[0].recorder.external_hash
    started = time.perf_counter()
    for index in sorted(range(len(trace)), key=lambda i: trace[i].timestamp):
        request, layout = trace[index], layouts[index]
        if layout.num_blocks > capacity:
            num_skipped += 1
            continue
        now = request.timestamp / 1000
        route = RouteRequest(
            tuple(to_external(h) for h in layout.block_hashes[: layout.num_prompt_blocks]),
            request.hash_ids,
        )
        request_id = str(index)
        tick = time.perf_counter()
        chosen = by_id[_choose(policy, route, replicas, now, request_id)]
        route_seconds += time.perf_counter() - tick
        num_hits = _run(chosen, request, layout, request_id)
        _feed_events(policy, chosen, now)
        ttfts.append(_advance_clock(chosen, request, request_id, num_hits, now, service))
        hit_tokens += num_hits
        query_tokens += request.input_length
    ttfts.sort()
    return ClusterReplayResult(
        router=policy.name,
        num_replicas=shape.num_replicas,
        capacity_blocks=capacity,
        num_requests=len(trace),
        num_skipped=num_skipped,
        hit_tokens=hit_tokens,
        query_tokens=query_tokens,
        requests_per_replica=tuple(r.num_requests for r in replicas),
        computed_tokens_per_replica=tuple(r.computed_tokens for r in replicas),
        ttft_p50_s=_quantile(ttfts, 0.5),
        ttft_p90_s=_quantile(ttfts, 0.9),
        route_seconds=route_seconds,
        seconds=time.perf_counter() - started,
    )


def _choose(
    policy: RoutingPolicy,
    route: RouteRequest,
    replicas: Sequence[_Replica],
    now: float,
    request_id: str,
) -> str:
    """The policy's choice for `route`, told back to it (and which requests ended before
    it): the chosen replica's id."""
    for replica in replicas:
        for ended in replica.finish_until(now):
            policy.on_finished(ended)
    loads = [ReplicaLoad(r.replica_id, len(r.finishes)) for r in replicas]
    chosen = policy.rank(route, loads, now)[0]
    policy.on_routed(route, chosen, now, request_id)
    return chosen


def _feed_events(policy: RoutingPolicy, replica: _Replica, now: float) -> None:
    """The replica's KV events since the last call, to the policy's index of it (kv only)."""
    events = replica.recorder.take()
    if isinstance(policy, KVAwarePolicy):
        policy.index(replica.replica_id).apply([KVEventBatch(ts=now, events=events)])


def _new_replica(replica_id: str, capacity: int, block_size: int) -> _Replica:
    recorder = KVEventRecorder()
    manager = KVCacheManager(
        num_blocks=capacity + 1, block_size=block_size, enable_caching=True, events=recorder
    )
    return _Replica(replica_id, manager, recorder)


def _run(replica: _Replica, request: TraceRequest, layout: BlockLayout, request_id: str) -> int:
    """Look the request up in the replica's pool and run it there; its hit tokens."""
    replayed = ReplayRequest(
        request_id, layout.block_hashes, request.input_length, lora_name=request.lora_name
    )
    hit_blocks, num_hits = replica.manager.get_computed_blocks(replayed)
    run_request(replica.manager, replayed, request, hit_blocks, num_hits)
    return num_hits


def _advance_clock(
    replica: _Replica,
    request: TraceRequest,
    request_id: str,
    num_hits: int,
    now: float,
    service: ServiceModel,
) -> float:
    """Queue the request's prefill on the replica; its TTFT."""
    computed = request.input_length - num_hits
    start = max(now, replica.prefill_free_at)
    first_token = start + computed / service.prefill_tokens_per_s
    replica.prefill_free_at = first_token
    end = first_token + request.output_length / service.decode_tokens_per_s
    heapq.heappush(replica.finishes, (end, request_id))
    replica.num_requests += 1
    replica.computed_tokens += computed
    return first_token - now


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
