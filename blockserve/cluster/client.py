"""`ClusterEngineClient`: the `EngineClient` of the ingress, backed by N engine replicas."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import cast

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from blockserve.cluster.replica import FrontEnd
from blockserve.engine.client import ModelInfo
from blockserve.engine.input_processor import InputProcessor
from blockserve.engine.outputs import EngineStats, KVCacheReport, MissRatioReport, RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.engine.tokenizer_pool import PoolTokenizing, TokenizerPool
from blockserve.errors import BlockserveError, EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a request is sent again while no output reached the client
_REPLICA_ADAPTERS = (
    "replicas serve the adapters of --lora-modules; one loaded at runtime would reach one "
    "replica only"
)


class ClusterEngineClient(PoolTokenizing):
    """Implements `EngineClient` over a deployment handle of `EngineReplica`s.

    The HTTP app (server/app.py) runs unchanged on top of it. Prompts are tokenized here, once,
    so the router can hash them and the replicas receive token ids (and a chat's images,
    decoded, processed and identified here); each replica validates the request again as it
    would alone. A replica that dies before a request's first output gets
    the request again elsewhere; one that dies mid-stream ends it with a clean 503.
    """

    def __init__(self, replicas: DeploymentHandle, front: FrontEnd, tokenizer_workers: int) -> None:
        self.replicas = replicas.options(stream=True)
        processor = InputProcessor(
            tokenizer=front.tokenizer,
            vocab_size=front.vocab_size,
            max_model_len=front.max_model_len,
            scheduling_policy=front.scheduling_policy,
            max_n=front.max_n,
            max_bytes_per_token=front.max_bytes_per_token,
            max_logprobs=front.max_logprobs,
            images=front.images,
        )
        self._tokenizers = TokenizerPool(processor, tokenizer_workers)
        self._model_info = ModelInfo(
            name=front.model_name,
            max_model_len=front.max_model_len,
            vocab_size=front.vocab_size,
            tokenizer=processor.tokenizer,
            default_sampling=front.default_sampling,
            runtime={**front.runtime, "replicas": "ray-serve"},
            lora_adapters=front.lora_adapters,
        )
        # request id -> the replica's response stream
        self._streams: dict[str, DeploymentResponseGenerator] = {}
        self._num_running = 0
        # Finished streams read to their end in the background (see _generate).
        self._draining: set[asyncio.Task[None]] = set()
        self._counts = _Counts()
        self._per_replica: dict[str, _Counts] = {}

    def start(self) -> None:
        pass  # the replicas are Ray Serve's to start

    def shutdown(self) -> None:
        self._tokenizers.shutdown()
        for stream in list(self._streams.values()):
            stream.cancel()

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        if spec.request_id in self._streams:
            raise InvalidRequestError(f"request id {spec.request_id!r} is already in use")
        if isinstance(spec.prompt, str):
            text = spec.prompt
            tokens = await self._tokenizers.run(lambda p: p.encode_text(text))
            spec = dataclasses.replace(spec, prompt=tokens)
        self._num_running += 1
        try:
            async for output in self._generate(spec):
                yield output
        finally:
            self._num_running -= 1
            stream = self._streams.pop(spec.request_id, None)
            if stream is not None:
                stream.cancel()  # a client gone early: the replica aborts the request

    async def _generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = cast(DeploymentResponseGenerator, self.replicas.generate.remote(spec))
            self._streams[spec.request_id] = stream
            streamed = False
            try:
                async for item in stream:
                    streamed = True
                    output = item.output
                    if output.finished:
                        self._counts.count(output)
                        self._per_replica.setdefault(item.replica_id, _Counts()).count(output)
                        # The replica's call ends on its own: read to its end, never cancelled.
                        # A cancel racing the call's end can lose Ray Serve's completion
                        # callback, and with it the router's count of work queued there.
                        finished = self._streams.pop(spec.request_id, None)
                        if finished is not None:  # None: aborted while this output was queued
                            self._drain(finished)
                    yield output
                return
            except RayTaskError as exc:
                if isinstance(exc.cause, BlockserveError):
                    raise exc.cause from None  # the replica refused it: its own error, no trace
                raise
            except RayActorError:
                if streamed or attempt == MAX_ATTEMPTS:
                    raise EngineDeadError("the replica serving this request died") from None
                logger.warning("replica died before request %s started; retrying", spec.request_id)

    def _drain(self, stream: DeploymentResponseGenerator) -> None:
        task = asyncio.get_running_loop().create_task(_read_to_end(stream))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    def is_healthy(self) -> bool:
        return True  # replicas are health-checked and restarted by Ray Serve

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """What passed through this ingress: requests in flight, tokens, prefix-cache hits."""
        return self._counts.snapshot(self._num_running)

    def replica_report(self) -> dict[str, dict[str, int]]:
        """Finished requests and their tokens per replica (those that died included)."""
        return {
            replica_id: dataclasses.asdict(counts)
            for replica_id, counts in sorted(self._per_replica.items())
        }

    async def load_lora(self, name: str, path: str) -> None:
        raise InvalidRequestError(_REPLICA_ADAPTERS)

    async def unload_lora(self, name: str) -> None:
        raise InvalidRequestError(_REPLICA_ADAPTERS)

    async def debug_kv_cache(self) -> KVCacheReport:
        raise InvalidRequestError("the KV cache report is per replica: ask a replica's engine")

    async def debug_miss_ratio_curve(self) -> MissRatioReport:
        raise InvalidRequestError("the miss-ratio curve is per replica: ask a replica's engine")


@dataclasses.dataclass(slots=True)
class _Counts:
    """Finished requests and their tokens."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0

    def count(self, output: RequestOutput) -> None:
        self.num_requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.cached_tokens += output.num_cached_tokens
        self.generation_tokens += sum(len(o.token_ids) for o in output.outputs)

    def snapshot(self, num_running: int) -> EngineStats:
        return EngineStats(
            num_running=num_running,
            num_waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_queries=self.prompt_tokens,
            prefix_cache_hits=self.cached_tokens,
            num_preemptions=0,
            num_prompt_tokens=self.prompt_tokens,
            num_generation_tokens=self.generation_tokens,
        )


async def _read_to_end(stream: DeploymentResponseGenerator) -> None:
    """What a finished request's stream still holds: its end (a replica yields nothing after
    the finished output), or the error of a replica that died just after it."""
    try:
        async for _ in stream:
            pass
    except Exception:  # the client has its output; nothing is left to tell it
        logger.debug("a finished request's stream ended with an error", exc_info=True)


async def fetch_front_end(replicas: DeploymentHandle) -> FrontEnd:
    """The model as the replicas serve it (any replica: they are identical)."""
    front: FrontEnd = await replicas.front_end.remote()
    return front
