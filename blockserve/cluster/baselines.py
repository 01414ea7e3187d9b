"""The baselines the kv router is raced against: Ray Serve's default (power of two choices),
round robin, and Ray Serve LLM's text-prefix affinity (PrefixCacheAffinityRouter: approximate,
on the prompt's text rather than its blocks, written from its documentation)."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence

from blockserve.cluster.routing import ReplicaLoad, RouteRequest


class _Oblivious:
    """A policy that keeps nothing of where requests went."""

    def on_routed(
        self, request: RouteRequest, replica_id: str, now: float, request_id: str
    ) -> None:
        pass

    def on_finished(self, request_id: str) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


class PowerOfTwoPolicy(_Oblivious):
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


class RoundRobinPolicy(_Oblivious):
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


class TextPrefixPolicy(_Oblivious):
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

    def on_routed(
        self, request: RouteRequest, replica_id: str, now: float, request_id: str
    ) -> None:
        if request.text:
            self.trees.setdefault(replica_id, TextTree()).insert(request.text)

    def forget(self, replica_id: str) -> None:
        self.trees.pop(replica_id, None)
