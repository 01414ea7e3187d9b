"""The Ray Serve application: N `EngineReplica`s behind an OpenAI-compatible ingress."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from blockserve.cluster.client import ClusterEngineClient, fetch_front_end
from blockserve.cluster.config import ClusterConfig
from blockserve.cluster.registry import router_report
from blockserve.cluster.replica import EngineReplica
from blockserve.core.hashing import BlockHasher
from blockserve.engine.arg_checks import lora_module
from blockserve.engine.args import EngineArgs
from blockserve.errors import InvalidConfigError
from blockserve.server.app import build_app as build_http_app
from blockserve.server.options import ServerConfig

ROUTING_STATS_PERIOD_S = 1.0  # how soon a new replica's event endpoint reaches the router
ROUTER_CLASSES = {
    "kv": "blockserve.cluster.router:KVCacheAwareRouter",
    "round-robin": "blockserve.cluster.router:PolicyRouter",
    "text-prefix": "blockserve.cluster.router:PolicyRouter",
}


class Ingress:
    """The HTTP front: blockserve's own FastAPI app over a `ClusterEngineClient`.

        client ──HTTP──> Ray Serve proxy ──> Ingress (FastAPI routes of server/app.py, tokenizes)
                                                │ DeploymentHandle; the router picks the replica
                                                ▼
                                  EngineReplica × N (one engine each, KV events on its own port)

    Two ways in: `blockserve serve --replicas N` (cluster/launch.py) and Ray's own `serve run
    blockserve.cluster.app:build_app key=value ...` / `serve deploy CONFIG.yaml`, whose `args`
    are `build_app`'s: any `blockserve serve` option by its field name (`model`, `block_size`,
    `replicas`, `router`, `port`, ...).
    """

    # Ray Serve awaits an async constructor; mypy cannot know.
    async def __init__(  # type: ignore[misc]
        self, replicas: DeploymentHandle, server_config: ServerConfig, model: str | None
    ) -> None:
        front = await fetch_front_end(replicas)
        self.client = ClusterEngineClient(replicas, front, server_config.tokenizer_workers)
        if not server_config.served_model_name:  # as `blockserve serve` names it
            served = (model or front.model_name,)
            server_config = dataclasses.replace(server_config, served_model_name=served)
        self.server_config = server_config

    def __serve_build_asgi_app__(self) -> Any:
        app = build_http_app(self.client, self.server_config)

        @app.get("/cluster/replicas")
        async def replicas() -> dict:
            """Per replica: finished requests, their prompt, cached and generated tokens; and
            the router's view: the replicas it can route to, their requests in flight and
            (kv) what it indexes of each (null under Ray's own pow2 router)."""
            return {"replicas": self.client.replica_report(), "router": router_report()}

        return app


def build_application(
    engine_args: EngineArgs, server_config: ServerConfig, cluster: ClusterConfig
) -> Application:
    """The application for `serve.run`: `cluster.replicas` engines behind one ingress."""
    if cluster.replicas < 1:
        raise InvalidConfigError("a cluster needs at least one replica (--replicas N)")
    hasher = BlockHasher(engine_args.prefix_caching_hash_algo)
    if hasher.random_seed:
        raise InvalidConfigError(
            f"{engine_args.prefix_caching_hash_algo} hashes are seeded per process unless "
            "PYTHONHASHSEED is set: set it, or the router and replicas cannot agree on a hash"
        )
    # The router hashes in the ingress, the engines in the replicas: one seed for all.
    env = {k: os.environ[k] for k in ("PYTHONHASHSEED",) if k in os.environ}
    actor_options = {"runtime_env": {"env_vars": env}}
    replica = serve.deployment(
        name="EngineReplica",
        num_replicas=cluster.replicas,
        max_ongoing_requests=engine_args.max_num_seqs * 4,
        ray_actor_options={"num_cpus": cluster.threads_per_replica, **actor_options},
        request_router_config=router_config(engine_args, cluster),
    )(EngineReplica)
    ingress = serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0, **actor_options})(
        serve.ingress()(Ingress)
    )
    replicas = replica.bind(engine_args, cluster.threads_per_replica)
    return ingress.bind(replicas, server_config, engine_args.model)


def router_config(engine_args: EngineArgs, cluster: ClusterConfig) -> dict[str, Any]:
    """Ray Serve's `RequestRouterConfig`: Ray's default (power of two choices) for pow2;
    blockserve's router for the others, hashing with the engines' block size and algorithm."""
    if cluster.router == "pow2":
        return {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    return {
        "request_router_class": ROUTER_CLASSES[cluster.router],
        "request_router_kwargs": {
            "policy": cluster.router,
            "block_size": engine_args.block_size,
            "hash_algo": engine_args.prefix_caching_hash_algo,
            "lora_paths": dict(lora_module(str(e)) for e in engine_args.lora_modules),
            "prefix_weight": cluster.router_prefix_weight,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder: `args` holds `blockserve serve` options by field
    name; each goes to the engine, server or cluster config that has it."""
    groups: dict[type, dict[str, Any]] = {EngineArgs: {}, ServerConfig: {}, ClusterConfig: {}}
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in groups}
    for key, value in args.items():
        owner = next((cls for cls in groups if key in names[cls]), None)
        if owner is None:
            raise InvalidConfigError(f"unknown option {key!r} in the application's args")
        groups[owner][key] = tuple(value) if isinstance(value, list) else value
    cluster = ClusterConfig(**{"replicas": 2, **groups[ClusterConfig]})
    engine_args = EngineArgs(**groups[EngineArgs])
    return build_application(engine_args, ServerConfig(**groups[ServerConfig]), cluster)
