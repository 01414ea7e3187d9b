"""`EngineReplica`: one engine inside one Ray Serve replica, publishing its KV events."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from blockserve.engine.args import EngineArgs
from blockserve.engine.async_engine import AsyncEngine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.errors import EngineDeadError
from blockserve.multimodal.prompts import ImagePrompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontEnd:
    """What the ingress needs to tokenize and check requests as the replicas would."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    default_sampling: dict[str, float | int]
    runtime: dict[str, str | int | bool]
    scheduling_policy: str
    max_n: int
    max_bytes_per_token: int | None
    num_blocks: int  # this replica's KV blocks: the bound of its mirror and credits
    max_logprobs: int = 20
    lora_adapters: dict[str, str] = field(default_factory=dict)  # --lora-modules: name -> path
    # A vision-language model's: how prompts take images (its processor cache travels empty).
    images: ImagePrompts | None = None


@dataclass(frozen=True, slots=True)
class ReplicaOutput:
    """A `RequestOutput` and the replica that produced it (per-replica accounting)."""

    replica_id: str
    output: RequestOutput


def events_config() -> dict[str, Any]:
    """KV events on OS-chosen ports, with a replay socket for gaps and late joiners."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }


def advertised(endpoint: str | None, host: str) -> str | None:
    """A bound endpoint (`tcp://0.0.0.0:PORT`) as others on the network reach it."""
    if endpoint is None:
        return None
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


class EngineReplica:
    """The body of the replica deployment (cluster/app.py applies Ray's decorator).

    The replica takes token ids (the ingress tokenized them), streams `RequestOutput`s back, and
    advertises where its KV events are published through Ray Serve's routing stats, which the
    router polls. Events go out on two ports chosen by the OS on this node, so any number of
    replicas can share a machine. Holds no routing logic.
    """

    def __init__(self, engine_args: EngineArgs, threads: int) -> None:
        import ray
        import torch
        from ray import serve

        torch.set_num_threads(threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        threads_flag = engine_args.cpu_threads or threads  # the replica's share, unless given
        args = dataclasses.replace(
            engine_args, kv_events_config=events_config(), cpu_threads=threads_flag
        )
        self.engine = AsyncEngine.from_config(args.create_configs())
        self._started = False
        core = self.engine.engine.core
        publisher = core.event_publisher
        host = ray.util.get_node_ip_address()
        self.kv_events_endpoint = advertised(getattr(publisher, "endpoint", None), host)
        self.kv_replay_endpoint = advertised(getattr(publisher, "replay_endpoint", None), host)
        processor = self.engine.engine.input_processor
        model_info = self.engine.model_info()
        self.front_end_info = FrontEnd(
            model_name=model_info.name,
            max_model_len=model_info.max_model_len,
            vocab_size=model_info.vocab_size,
            tokenizer=processor.tokenizer,
            default_sampling=dict(model_info.default_sampling),
            runtime=dict(model_info.runtime),
            scheduling_policy=processor.scheduling_policy,
            max_n=processor.max_n,
            max_bytes_per_token=processor.max_bytes_per_token,
            num_blocks=core.info.num_blocks,
            max_logprobs=processor.max_logprobs,
            lora_adapters=dict(model_info.lora_adapters),
            images=processor.images,
        )
        logger.info("replica ready; KV events on %s", self.kv_events_endpoint)

    def _ensure_started(self) -> None:
        # The engine delivers outputs to the loop that starts it: Serve's, known only here.
        if not self._started:
            self.engine.start()
            self._started = True

    async def generate(self, spec: RequestSpec) -> AsyncIterator[ReplicaOutput]:
        """Stream the request's outputs (its prompt is token ids; it is validated here)."""
        self._ensure_started()
        async for output in self.engine.generate(spec):
            yield ReplicaOutput(self.replica_id, output)

    async def front_end(self) -> FrontEnd:
        return self.front_end_info

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray Serve for the router: where this replica's KV events are, and how
        many blocks it holds at most."""
        return {
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_replay_endpoint": self.kv_replay_endpoint,
            "num_blocks": self.front_end_info.num_blocks,
        }

    async def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine loop fails it, and Serve restarts us."""
        if self._started and not self.engine.is_healthy():
            raise EngineDeadError("the engine loop died")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)
