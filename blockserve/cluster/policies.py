"""Routing policies: which replica serves a request. One copy of the scoring, used by the Ray
Serve router (cluster/router.py) and by the cluster replay (replay/cluster.py).

A policy sees each candidate's load (requests in flight) and its own per-replica state; it
returns the candidates best first and is told where each request went. It owns no sockets,
threads or clock: callers pass `now`, and feed KV events into `KVAwarePolicy.index(...)`.

- `kv`: exact prefix overlap from the replicas' KV events minus load (below);
- `pow2`: two random candidates, the less loaded first (Ray Serve's default);
- `round-robin`: in turn;
- `text-prefix`: Ray Serve LLM's PrefixCacheAffinityRouter algorithm (approximate, on the
  prompt's text rather than its blocks), written from its documentation.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from blockserve.cluster.index import DEFAULT_CREDIT_TTL_S, PrefixIndex
from blockserve.core.events import ExternalBlockHash
from blockserve.core.hashing import BlockHasher, block_hash_to_uint64
from blockserve.engine.request import RequestSpec
from blockserve.errors import InvalidConfigError

DEFAULT_PREFIX_WEIGHT = 8.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may read of a request: its leading block hashes in the replicas' event
    form, and a text (or any symbol sequence) for the text-prefix baseline."""

    block_hashes: tuple[ExternalBlockHash, ...]
    text: str | tuple[int, ...] = ""


def route_request(spec: RequestSpec, hasher: BlockHasher, block_size: int) -> RouteRequest:
    """The request as a policy sees it: its full prompt blocks hashed exactly as the engines
    hash them (same algorithm, seed, block size, cache salt and LoRA name), in event form."""
    assert not isinstance(spec.prompt, str), "the ingress sends token ids"
    hashes = hasher.hash_prompt(spec.prompt, block_size, spec.cache_salt, spec.lora_name)
    return RouteRequest(tuple(block_hash_to_uint64(h) for h in hashes), spec.prompt)


class ReplicaLoad(NamedTuple):
    replica_id: str
    num_requests: int  # in flight: routed here and not yet finished


class RoutingPolicy(Protocol):
    name: str

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        """Candidate ids, best first (a non-empty prefix of them when `replicas` is not empty)."""

    def on_routed(self, request: RouteRequest, replica_id: str, now: float) -> None:
        """`request` was sent to `replica_id`."""

    def forget(self, replica_id: str) -> None:
        """`replica_id` is gone: drop what is known of it."""


class Score(NamedTuple):
    replica_id: str
    overlap: int  # leading blocks held or credited
    value: float  # prefix_weight * overlap / num_blocks - load


class KVAwarePolicy:
    """Exact prefix overlap minus load.

        score(r) = prefix_weight * overlap(r) / num_blocks - load(r)

    `overlap(r)`: the request's leading blocks replica r holds (its KV events) or was credited
    with (requests routed to it whose blocks it has not announced yet); `load(r)`: its requests
    in flight. A full prefix hit is worth `prefix_weight` queued requests: the replica holding
    the prefix wins until its queue is longer by more than that. Ties go to the less loaded
    replica, then to the one with fewer cached and credited blocks (new prefixes spread to
    emptier caches), then in turn (a start that rotates through the order given). A request
    shorter than one block scores 0 everywhere: least loaded wins.
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
        self._turn = itertools.count()

    def index(self, replica_id: str) -> PrefixIndex:
        """The replica's index, created empty on first use (a new or restarted replica)."""
        index = self.indices.get(replica_id)
        if index is None:
            index = PrefixIndex(self.max_blocks_per_replica, self.credit_ttl_s)
            self.indices[replica_id] = index
        return index

    def scores(
        self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float
    ) -> list[Score]:
        num_blocks = len(request.block_hashes)
        scored = []
        for replica in replicas:
            overlap = self.index(replica.replica_id).overlap(request.block_hashes, now)
            prefix_term = self.prefix_weight * overlap / num_blocks if num_blocks else 0.0
            scored.append(Score(replica.replica_id, overlap, prefix_term - replica.num_requests))
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

    def on_routed(self, request: RouteRequest, replica_id: str, now: float) -> None:
        self.index(replica_id).credit(request.block_hashes, now)

    def _size(self, replica_id: str) -> int:
        index = self.index(replica_id)
        return index.num_blocks + index.num_credits

    def forget(self, replica_id: str) -> None:
        index = self.indices.pop(replica_id, None)
        if index is not None:
            index.clear()


class PowerOfTwoPolicy:
    """Two distinct random candidates, the less loaded first (a coin decides ties)."""

    name = "pow2"

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        if len(replicas) <= 1:
            return [r.replica_id for r in replicas]
        first, second = self._random.sample(list(replicas), 2)
        if second.num_requests < first.num_requests:
            first, second = second, first
        return [first.replica_id, second.replica_id]

    def on_routed(self, request: RouteRequest, replica_id: str, now: float) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


class RoundRobinPolicy:
    """Each request to the next candidate in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        if not replicas:
            return []
        start = next(self._counter) % len(replicas)
        ordered = sorted(r.replica_id for r in replicas)
        return ordered[start:] + ordered[:start]

    def on_routed(self, request: RouteRequest, replica_id: str, now: float) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


class TextTree:
    """The prompts sent to one replica, as a prefix tree would hold them: longest match of a
    new prompt, and the tree's size in symbols (shared prefixes counted once). A sorted list:
    the longest common prefix with a set of strings is found at a neighbour in sorted order."""

    def __init__(self) -> None:
        self._texts: list[str | tuple[int, ...]] = []
        self.num_symbols = 0

    def match(self, text: str | tuple[int, ...]) -> int:
        at = bisect.bisect_left(self._texts, text)
        neighbours = self._texts[max(at - 1, 0) : at + 1]
        return max((_common_prefix(text, other) for other in neighbours), default=0)

    def insert(self, text: str | tuple[int, ...]) -> None:
        matched = self.match(text)
        at = bisect.bisect_left(self._texts, text)
        if at < len(self._texts) and self._texts[at] == text:
            return
        self._texts.insert(at, text)
        self.num_symbols += len(text) - matched


def _common_prefix(a: str | tuple[int, ...], b: str | tuple[int, ...]) -> int:
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


class TextPrefixPolicy:
    """Ray Serve LLM's PrefixCacheAffinityRouter, from its documentation: while the queue
    lengths differ by at most `imbalanced_threshold`, send a prompt to the replicas whose
    tree matches the most of it — or, below `match_rate_threshold` of it, to those with the
    smallest trees — the least loaded of them first; when imbalanced, power of two choices.
    Each routed prompt is inserted into its replica's tree (no eviction: Ray's default)."""

    name = "text-prefix"

    def __init__(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        seed: int | None = None,
    ) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.trees: dict[str, TextTree] = {}
        self._fallback = PowerOfTwoPolicy(seed)

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        loads = [r.num_requests for r in replicas]
        if not replicas or not request.text or max(loads) - min(loads) > self.imbalanced_threshold:
            return self._fallback.rank(request, replicas, now)
        trees = [self.trees.setdefault(r.replica_id, TextTree()) for r in replicas]
        matches = [tree.match(request.text) for tree in trees]
        if max(matches) / len(request.text) >= self.match_rate_threshold:
            keys = [-m for m in matches]
        else:
            keys = [tree.num_symbols for tree in trees]
        best = min(keys)
        chosen = [r for r, key in zip(replicas, keys, strict=True) if key == best]
        return [r.replica_id for r in sorted(chosen, key=lambda r: r.num_requests)]

    def on_routed(self, request: RouteRequest, replica_id: str, now: float) -> None:
        if request.text:
            self.trees.setdefault(replica_id, TextTree()).insert(request.text)

    def forget(self, replica_id: str) -> None:
        self.trees.pop(replica_id, None)


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
