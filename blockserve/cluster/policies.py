"""Routing policies: which replica serves a request. One copy of the scoring, used by the Ray
Serve router (cluster/router.py) and by the cluster replay (replay/cluster_sim.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from blockserve.cluster.baselines import PowerOfTwoPolicy, RoundRobinPolicy, TextPrefixPolicy
from blockserve.cluster.index import DEFAULT_CREDIT_TTL_S, PrefixIndex
from blockserve.cluster.routing import ReplicaLoad, RouteRequest, RoutingPolicy
from blockserve.errors import InvalidConfigError
from blockserve.events.subscriber import CacheMirror

DEFAULT_PREFIX_WEIGHT = 2.0
# What a block loaded from the shared tier saves of computing it: on the host measured a
# 4,096-token prefix loaded in 0.03-0.04 of its prefill's time (bench_tiers.py --section shared);
# a faster device computes more of it in the time a load takes.
SHARED_CREDIT = 0.9
_MAX_TRACKED = 100_000  # requests routed whose end was never reported: the oldest are dropped


class Score(NamedTuple):
    replica_id: str
    overlap: int  # leading blocks held or credited
    queued: int  # blocks of work routed here and not finished
    value: float  # prefix_weight * (overlap + SHARED_CREDIT * shared) - queued
    shared: int = 0  # blocks after those it could load from the shared tier


class KVAwarePolicy:
    """Exact prefix overlap against the work queued on each replica, in blocks.

        score(r) = prefix_weight * (overlap(r) + SHARED_CREDIT * shared(r)) - queued(r)

    `shared(r)`: the blocks after those that r could load from the tier every replica shares
    (--kv-remote-url; any replica's events with medium "REMOTE" say what it holds): a block
    loaded saves most of computing it, less than one held. `overlap(r)`: the request's leading
    blocks replica r holds (its KV events) or was credited with (requests routed to it whose
    blocks it has not announced yet). `queued(r)`: the blocks r has to compute for the
    requests routed to it and not finished, each counted at what it missed when it was routed
    (at least 1: a full hit still decodes; a block it loads counts 1 - SHARED_CREDIT). With weight 1
    the best replica is the one with the least prefill ahead of this request's first token
    (its own missing blocks plus the queue: num_blocks is the same everywhere). The default, 2,
    also charges a replica that computes a prefix again for the time every request behind it
    waits meanwhile: the replica holding the prefix wins until its queue is longer by more than
    twice the blocks it saves. Ties go to the less loaded replica (requests in flight), then to
    the one with fewer cached and credited blocks (new prefixes spread to emptier caches),
    then in turn (a start that rotates through the order given). A request shorter than one
    block has no overlap anywhere: the shortest queue wins.

    A policy sees each candidate's load (requests in flight) and its own per-replica state; it
    returns the candidates best first and is told where each request went and when it finished.
    It owns no sockets, threads or clock: callers pass `now`, and feed KV events into
    `KVAwarePolicy.index(...)`.

    - `kv`: exact prefix overlap from the replicas' KV events against the work queued on each
      (below);
    - `pow2`, `round-robin`, `text-prefix`: the baselines (cluster/baselines.py).
    """

    name = "kv"

    def __init__(
        self,
        max_blocks_per_replica: int,
        prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
        credit_ttl_s: float = DEFAULT_CREDIT_TTL_S,
    ) -> None:
        if prefix_weight < 0:
            raise InvalidConfigError(f"prefix_weight must be >= 0, got {prefix_weight}")
        self.prefix_weight = prefix_weight
        self.max_blocks_per_replica = max_blocks_per_replica
        self.credit_ttl_s = credit_ttl_s
        self.indices: dict[str, PrefixIndex] = {}
        self.shared = CacheMirror()  # the shared tier's blocks, from every replica's events
        self.queued: dict[str, int] = {}  # replica -> blocks routed there, not finished
        self._routed: dict[str, tuple[str, int]] = {}  # request id -> (replica, its blocks)
        self._turn = itertools.count()

    def index(self, replica_id: str) -> PrefixIndex:
        """The replica's index, created empty on first use (a new or restarted replica)."""
        index = self.indices.get(replica_id)
        if index is None:
            index = PrefixIndex(self.max_blocks_per_replica, self.credit_ttl_s, self.shared)
            self.indices[replica_id] = index
        return index

    def scores(
        self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float
    ) -> list[Score]:
        scored = []
        for replica in replicas:
            index = self.index(replica.replica_id)
            overlap = index.overlap(request.block_hashes, now)
            shared = index.shared_overlap(request.block_hashes, overlap)
            queued = self.queued.get(replica.replica_id, 0)
            value = self.prefix_weight * (overlap + SHARED_CREDIT * shared) - queued
            scored.append(
                Score(
                    replica_id=replica.replica_id,
                    overlap=overlap,
                    queued=queued,
                    value=value,
                    shared=shared,
                )
            )
        return scored

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        scored = self.scores(request, replicas, now)
        # The last tie-break turns: full caches of equal size must not all pick the first.
        start = next(self._turn) % len(replicas) if replicas else 0
        order = sorted(
            range(len(replicas)),
            key=lambda i: (
                -scored[i].value,
                replicas[i].num_requests,
                self._size(replicas[i].replica_id),
                (i - start) % len(replicas),
            ),
        )
        return [replicas[i].replica_id for i in order]

    def on_routed(
        self, request: RouteRequest, replica_id: str, now: float, request_id: str
    ) -> None:
        index = self.index(replica_id)
        overlap = index.overlap(request.block_hashes, now)
        loaded = round(SHARED_CREDIT * index.shared_overlap(request.block_hashes, overlap))
        missed = max(len(request.block_hashes) - overlap - loaded, 1)
        self.on_finished(request_id)  # an id routed again (a retry) counts once
        self._routed[request_id] = (replica_id, missed)
        self.queued[replica_id] = self.queued.get(replica_id, 0) + missed
        if len(self._routed) > _MAX_TRACKED:
            self.on_finished(next(iter(self._routed)))
        index.credit(request.block_hashes, now)

    def on_finished(self, request_id: str) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            replica_id, missed = routed
            if replica_id in self.queued:
                self.queued[replica_id] -= missed

    def _size(self, replica_id: str) -> int:
        index = self.index(replica_id)
        return index.num_blocks + index.num_credits

    def forget(self, replica_id: str) -> None:
        self.queued.pop(replica_id, None)
        self._routed = {k: v for k, v in self._routed.items() if v[0] != replica_id}
        index = self.indices.pop(replica_id, None)
        if index is not None:
            index.clear()


POLICIES = ("kv", "pow2", "round-robin", "text-prefix")


def make_policy(
    name: str,
    max_blocks_per_replica: int,
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
    seed: int | None = None,
) -> RoutingPolicy:
    """The policy called `name` (one of POLICIES); InvalidConfigError for any other."""
    if name == "kv":
        return KVAwarePolicy(max_blocks_per_replica, prefix_weight)
    if name == "pow2":
        return PowerOfTwoPolicy(seed)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "text-prefix":
        return TextPrefixPolicy(seed=seed)
    raise InvalidConfigError(f"unknown router {name!r}; choose from {', '.join(POLICIES)}")
