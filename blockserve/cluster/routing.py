"""What a routing policy sees and says: the request as hashed blocks, each candidate's load,
and the policy protocol the Ray Serve router (cluster/router.py) and the cluster replay
(replay/cluster_sim.py) drive."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from blockserve.core.events import ExternalBlockHash
from blockserve.core.hashing import BlockHasher, MultiModalFeature, block_hash_to_uint64
from blockserve.engine.request import RequestSpec


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may read of a request: its leading block hashes in the replicas' event
    form, and a text (or any symbol sequence) for the text-prefix baseline."""

    block_hashes: tuple[ExternalBlockHash, ...]
    text: str | tuple[int, ...] = ""


def route_request(
    spec: RequestSpec,
    hasher: BlockHasher,
    block_size: int,
    lora_paths: Mapping[str, str] | None = None,
) -> RouteRequest:
    """The request as a policy sees it: its full prompt blocks hashed exactly as the engines
    hash them (same algorithm, seed, block size, cache salt, its images' identifiers and
    spans, and the adapter's name and path from `lora_paths`, the replicas' --lora-modules),
    in event form."""
    assert isinstance(spec.prompt, tuple), "the ingress sends token ids"
    lora = None
    if spec.lora_name is not None:
        lora = (spec.lora_name, (lora_paths or {}).get(spec.lora_name, ""))
    images = [MultiModalFeature(i.identifier, i.offset, i.length) for i in spec.images]
    hashes = hasher.hash_prompt(spec.prompt, block_size, spec.cache_salt, lora, images)
    return RouteRequest(tuple(block_hash_to_uint64(h) for h in hashes), spec.prompt)


class ReplicaLoad(NamedTuple):
    replica_id: str
    num_requests: int  # in flight: routed here and not yet finished


class InFlight:
    """Each replica's requests in flight from one router, from Ray Serve's two reports of a
    request, which can come in either order: Serve registers the callback that reports a
    request's end before it awaits the replica's accept, and reports it routed only after, so
    a short request can end first (counted for good before this class: what the cluster test
    saw once on a loaded host, one request per replica). Serve also reports the end of an
    attempt that a full replica refused, which it never reports routed.

    Invariant: a request is counted on a replica from its routing to its end, at most once;
    an end with nothing counted is remembered (the oldest of `max_unmatched` dropped) so the
    routing that follows it counts nothing. The one miscount left: a refused attempt's end
    followed by the request's routing to that same replica leaves that run uncounted.
    """

    def __init__(self, max_unmatched: int = 10_000) -> None:
        self._requests: dict[str, set[str]] = {}  # replica -> request ids
        self._ended_first: dict[tuple[str, str], None] = {}  # (replica, request id), oldest first
        self._max_unmatched = max_unmatched

    def routed(self, replica_id: str, request_id: str) -> bool:
        """Count the request on the replica; False (nothing counted) where its end came first."""
        if (replica_id, request_id) in self._ended_first:
            del self._ended_first[(replica_id, request_id)]
            return False
        self._requests.setdefault(replica_id, set()).add(request_id)
        return True

    def ended(self, replica_id: str, request_id: str) -> bool:
        """Stop counting the request; False where it was not counted there (yet)."""
        requests = self._requests.get(replica_id, set())
        if request_id in requests:
            requests.discard(request_id)
            return True
        self._ended_first[(replica_id, request_id)] = None
        if len(self._ended_first) > self._max_unmatched:
            del self._ended_first[next(iter(self._ended_first))]
        return False

    def count(self, replica_id: str) -> int:
        return len(self._requests.get(replica_id, ()))

    def forget(self, replica_id: str) -> None:
        self._requests.pop(replica_id, None)
        self._ended_first = {k: v for k, v in self._ended_first.items() if k[0] != replica_id}


class RoutingPolicy(Protocol):
    name: str

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaLoad], now: float) -> list[str]:
        """Candidate ids, best first (a non-empty prefix of them when `replicas` is not empty)."""

    def on_routed(
        self, request: RouteRequest, replica_id: str, now: float, request_id: str
    ) -> None:
        """`request` (called `request_id` by the caller) was sent to `replica_id`."""

    def on_finished(self, request_id: str) -> None:
        """The request routed as `request_id` ended (finished, failed or cancelled)."""

    def forget(self, replica_id: str) -> None:
        """`replica_id` is gone: drop what is known of it."""
