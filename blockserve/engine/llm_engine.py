"""`LLMEngine`: the synchronous engine, an input processor, an engine core and an output processor
joined; `build_engine` wires all of it from the configs. Requests go in as `RequestSpec`s
(checked once, by the input processor) and come out as `RequestOutput`s. The offline `LLM` drives
it directly; `AsyncEngine` drives it from a thread. Speaks no HTTP."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from blockserve.config import EngineConfig
from blockserve.engine.core import EngineCore
from blockserve.engine.generation_config import default_sampling
from blockserve.engine.input_processor import InputProcessor, longest_token_bytes
from blockserve.engine.output_processor import OutputProcessor
from blockserve.engine.outputs import (
    EngineStats,
    ImageStats,
    KVCacheReport,
    LoRAStats,
    MissRatioReport,
    RequestOutput,
)
from blockserve.engine.request import RequestSpec, ValidatedRequest
from blockserve.errors import InvalidRequestError, ModelNotFoundError
from blockserve.lora.manager import LoRAManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Add requests, call `step()` until `has_unfinished_requests()` is False."""

    def __init__(
        self,
        core: EngineCore,
        input_processor: InputProcessor,
        default_sampling: Mapping[str, float | int] | None = None,
    ) -> None:
        self.core = core
        self.input_processor = input_processor
        # The model's generation-config defaults (engine/generation_config.py), for front ends.
        self.default_sampling: Mapping[str, float | int] = dict(default_sampling or {})
        self.output_processor = OutputProcessor(input_processor.tokenizer)
        self._pending_outputs: list[RequestOutput] = []

    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    def add_request(self, spec: RequestSpec) -> None:
        """Validate, tokenize and queue a request; InvalidRequestError changes nothing."""
        self.add_validated(self.input_processor.process(spec, self.output_processor))

    def add_validated(self, request: ValidatedRequest) -> None:
        """Queue a request that an input processor of this engine already checked.

        ModelNotFoundError, nothing queued, when its adapter was unloaded since the check (on
        another thread): on the engine's thread an adapter is either gone before its request
        arrives, or counted as in use by the unload."""
        name = request.spec.lora_name
        if name is not None and (self.core.lora is None or not self.core.lora.serves(name)):
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.")
        for core_request in self.output_processor.add_request(request):
            self.core.add_request(core_request)

    def add_lora(self, name: str, path: str) -> None:
        """Read, check and register an adapter (LoRAError when it cannot be served)."""
        self.lora_manager().register(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter; refused (InvalidRequestError) while requests use it."""
        manager = self.lora_manager()
        if name not in manager.registry:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.")
        users = sum(r.lora_name == name for r in self.core.scheduler.requests.values())
        if users:
            raise InvalidRequestError(
                f"The lora adapter '{name}' is in use by {users} running or waiting "
                "requests; unload it once they finish",
                "lora_name",
            )
        manager.unregister(name)

    def lora_manager(self) -> LoRAManager:
        if self.core.lora is None:
            raise InvalidRequestError("LoRA adapters are served with --enable-lora only")
        return self.core.lora

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """End requests now; their blocks are freed (and stay cached) before the next step.
        Their final outputs come with the next `step()`."""
        aborted = self.output_processor.abort(request_ids)
        self.core.abort_requests(aborted.samples_to_abort)
        self._pending_outputs += aborted.request_outputs

    def abort_all(self) -> None:
        self.abort_request(list(self.output_processor.live_request_ids()))

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step: an output for every request that changed (or was aborted);
        `final_only`: for every request that ended (the offline API's outputs)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.core.has_unfinished_requests():
            return outputs
        processed = self.output_processor.process(self.core.step(), final_only)
        self.core.abort_requests(processed.samples_to_abort)
        for sample in processed.samples_to_add:
            self.core.add_request(sample)
        return outputs + processed.request_outputs

    def stats(self) -> EngineStats:
        """The core's gauges and counters, with the token counts of the output processor."""
        return EngineStats(
            **dataclasses.asdict(self.core.stats()),
            num_prompt_tokens=self.output_processor.num_prompt_tokens,
            num_generation_tokens=self.output_processor.num_generation_tokens,
            estimated_hit_rates=self.core.estimated_hit_rates(),
            kv_tiers=self.core.tier_stats(),
            lora=self._lora_stats(),
            images=self._image_stats(),
        )

    def _image_stats(self) -> ImageStats | None:
        images, cache = self.input_processor.images, self.core.scheduler.encoder_cache
        runner_images = self.core.runner.images
        if images is None or cache is None or runner_images is None:
            return None
        processed = images.cache
        return ImageStats(
            processor_cache_queries=0 if processed is None else processed.queries,
            processor_cache_hits=0 if processed is None else processed.hits,
            encoded_images=runner_images.num_encoded,
            encoder_seconds=runner_images.encode_seconds,
            encoder_cache_embeds=cache.cache_size - cache.num_free,
            encoder_cache_size=cache.cache_size,
        )

    def _lora_stats(self) -> LoRAStats | None:
        lora = self.core.lora
        if lora is None:
            return None
        scheduler = self.core.scheduler

        def names(requests: Iterable[Any]) -> tuple[str, ...]:
            return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))

        host = lora.host
        return LoRAStats(
            max_loras=lora.config.max_loras,
            running=names(scheduler.running),
            waiting=names(scheduler.waiting),
            loads=host.loads,
            load_seconds=host.load_seconds,
        )

    def kv_cache_report(self) -> KVCacheReport:
        return self.core.kv_cache_report()

    def miss_ratio_report(self) -> MissRatioReport:
        return self.core.miss_ratio_report()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared); False while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()


def build_engine(config: EngineConfig) -> LLMEngine:
    """The whole engine from its configs: load the model, size the cache, wire the parts."""
    core = EngineCore(config)
    info = core.info
    logger.info(
        "model %s (%s, dtype %s), context %d tokens, on %s",
        info.model_name,
        info.model_path,
        info.dtype,
        info.max_model_len,
        core.runner_info.host_line,
    )
    if core.runner_info.compile_line is not None:
        logger.info("torch.compile: %s", core.runner_info.compile_line)
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens; prefix caching %s (%s)",
        info.num_blocks,
        info.block_size,
        info.num_blocks * info.block_size,
        "on" if config.cache.enable_prefix_caching else "off",
        config.cache.prefix_caching_hash_algo,
    )
    defaults = default_sampling(Path(info.model_path), config.model.generation_config)
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation config (a request's own "
            "values win; --generation-config vllm ignores them): %s",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    processor = InputProcessor(
        tokenizer=core.tokenizer,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        scheduling_policy=config.scheduler.scheduling_policy,
        max_n=config.scheduler.max_n,
        max_bytes_per_token=longest_token_bytes(core.tokenizer, info.vocab_size),
        max_logprobs=config.model.max_logprobs,
        grammar=core.runner_info.grammar,
        lora_names=core.lora.registry if core.lora is not None else None,
        images=core.runner_info.images,
    )
    return LLMEngine(core, processor, defaults)
