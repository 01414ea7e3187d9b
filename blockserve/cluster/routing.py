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
