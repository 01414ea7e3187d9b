"""`ClusterConfig`: how many engine replicas, routed how (`blockserve serve --replicas N`)."""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT, POLICIES
from blockserve.options import at_least, option, positive


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value!r}"


@dataclass(frozen=True)
class ClusterConfig:
    """The Ray Serve application's shape. `replicas` 0 means no cluster: one engine in this
    process (the plain `blockserve serve`)."""

    replicas: int = option(
        0,
        "serve N engine replicas on Ray Serve behind a prefix-aware router (0: one engine in "
        "this process, no Ray)",
        check=at_least(0),
    )
    router: str = option(
        "kv",
        "how requests pick a replica: kv (exact prefix overlap from the replicas' KV events, "
        "against the work queued on each), pow2 (Ray Serve's default), round-robin, "
        "text-prefix (Ray Serve LLM's approximate prefix router)",
        choices=POLICIES,
    )
    router_prefix_weight: float = option(
        DEFAULT_PREFIX_WEIGHT,
        "kv router: how many blocks of work queued on a replica one prompt block it holds is worth",
        check=_non_negative,
    )
    ray_address: str | None = option(
        None, "the Ray cluster to join (ray start --head prints it); default: start one here"
    )
    threads_per_replica: int = option(
        1,
        "torch threads (and Ray CPUs) per replica on a CPU host: N replicas share the cores "
        "without oversubscription",
        check=positive,
    )
