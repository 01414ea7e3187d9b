"""`EngineCore`: the scheduler, the model runner and KV-event publishing, token ids in and out."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from blockserve.config import EngineConfig
from blockserve.core.events import KVEventBatch, KVEventRecorder
from blockserve.core.eviction import TailLRUConfig
from blockserve.core.explain import CacheExplanation
from blockserve.core.hashing import BlockHasher, BlockKeyInputs, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager, RequestId
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.engine.outputs import (
    CoreStats,
    KVCacheReport,
    MissRatioReport,
    TierStats,
)
from blockserve.engine.reports import kv_cache_report, miss_ratio_report
from blockserve.engine.request import EngineCoreRequest, SampleId
from blockserve.engine.tier_feed import create_kv_tiers, filled_blocks, tier_stats
from blockserve.errors import InvalidConfigError
from blockserve.events.publisher import create_event_publisher
from blockserve.runner.build import build_runner, capture_decode_graphs, warm_up_device
from blockserve.runner.page_mapping import blocks_per_step
from blockserve.sched.output import RequestUpdate
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

_LOAD_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """What one step did: token updates, samples admitted (or re-admitted) this step with
    their prefix-cache hit (in tokens, and the part of it from each lower tier), and samples
    that failed, with the error. Ids are the ones the samples were added with (`SampleId`s,
    from the engine)."""

    timestamp: float
    updates: tuple[RequestUpdate, ...] = ()
    started: tuple[tuple[RequestId, int, CacheExplanation | None, dict[str, int]], ...] = ()
    errors: Mapping[RequestId, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the core settled on at start-up, for the front end and the start-up log."""

    model_name: str
    model_path: str
    dtype: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    # Where it runs: device, CPU architecture and ISA level, native bf16, dtype, threads.
    runtime: Mapping[str, str | int | bool] = field(default_factory=dict)


class EngineCore:
    """Add requests, call `step()` while `has_unfinished_requests()`; abort at any time.

    Owns the one step loop body: schedule, run the model, update the scheduler, publish the
    step's KV events. Knows no text, no `n` and no HTTP: its surface is plain data
    (`EngineCoreRequest` in, `EngineCoreOutputs` out), so it could run in a process of its own.
    A failing model step fails the requests in it, never the core.
    """

    def __init__(self, config: EngineConfig) -> None:
        sched = config.scheduler
        per_step = blocks_per_step(
            sched.max_num_batched_tokens, sched.max_num_seqs, config.cache.block_size
        )
        self.runner = build_runner(config.model, config.cache, per_step)
        loaded = self.runner.loaded
        max_model_len = _context_length(config, self.runner.num_blocks, loaded.arch)
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        warm_up_device(self.runner, max_model_len)  # nothing compiles once ready
        graphs = capture_decode_graphs(
            self.runner, config.model, config.scheduler.max_num_seqs, max_model_len
        )
        if graphs is not None:
            logger.info(graphs.line())
        events = config.kv_events
        self.event_publisher = create_event_publisher(events)
        recorder = None
        if events is not None and events.enabled:
            recorder = KVEventRecorder(hash_format=events.hash_format)  # type: ignore[arg-type]
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.runner.num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            events=recorder,
            eviction_policy=cache.eviction_policy,
            tlru=TailLRUConfig(cache.tlru_threshold_tokens, cache.tlru_next_prompt_tokens),
        )
        self.miss_ratio_curve: MissRatioCurve | None = None
        if cache.enable_prefix_caching and cache.miss_ratio_samples:
            usable = self.runner.num_blocks - 1
            # Gauges at 1/8x to 8x this cache, read after every step (O(1) each).
            points = sorted({max(1, round(usable * 2.0**k)) for k in range(-3, 4)})
            self.miss_ratio_curve = MissRatioCurve(
                cache.block_size, points, cache.miss_ratio_samples
            )
            self.kv_cache_manager.track_miss_ratio(self.miss_ratio_curve)
        hasher = BlockHasher(cache.prefix_caching_hash_algo)
        self.block_hasher = RequestBlockHasher(hasher, cache.block_size)
        self.kv_tiers, self._kv_dir = create_kv_tiers(
            cache, self.runner, hasher, recorder.hash_format if recorder is not None else None
        )
        self.scheduler = Scheduler(
            config=self.scheduler_config,
            kv_cache_manager=self.kv_cache_manager,
            eos_token_ids=self.runner.eos_token_ids,
            tiers=self.kv_tiers,
        )
        self.info = CoreInfo(
            model_name=loaded.name,
            model_path=str(loaded.model_dir),
            dtype=str(loaded.dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            vocab_size=loaded.arch.vocab_size,
            num_blocks=self.runner.num_blocks,
            block_size=cache.block_size,
            runtime={
                **self.runner.host.report(loaded.dtype),
                "compiled": self.runner.compile_report is not None,
                "cuda_graphs": 0 if graphs is None else len(graphs.sizes),
            },
        )

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer, for the front end to take at build time."""
        return self.runner.loaded.tokenizer

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated sample (the core trusts it)."""
        keys = BlockKeyInputs(cache_salt=request.cache_salt, lora_name=request.lora_name)
        sample = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_hasher=self.block_hasher,
            hash_keys=keys,
            priority=request.priority,
        )
        sample.explain_cache = request.explain_cache
        sample.group_id = request.group_id or request.request_id.request_id
        self.scheduler.add_request(sample)

    def abort_requests(self, request_ids: Iterable[SampleId]) -> None:
        """End samples now; their blocks are freed (and stay cached) before the next step."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, apply its tokens and publish the step's KV events."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.kv_tiers is not None and self.scheduler.num_loading:
            self.kv_tiers.wait_for_loads(_LOAD_WAIT_S)  # nothing to run until a load is in
        now = time.monotonic()
        requests = self.scheduler.requests
        started = tuple(
            (
                s.request_id,
                s.num_computed_tokens,
                requests[s.request_id].cache_explanation,
                requests[s.request_id].tier_cached_tokens,
            )
            for s in scheduler_output.scheduled
            if s.new_request is not None
        )
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:  # the batch fails; the core goes on
            logger.exception(
                "model step failed; failing the %d requests in it", len(scheduler_output.scheduled)
            )
            failed = [s.request_id for s in scheduler_output.scheduled]
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
            # The error is the batch's, not any one request's: its text (which may quote
            # another request's input) stays in the log.
            error = f"the model step failed ({type(exc).__name__}); the server log has details"
            return EngineCoreOutputs(now, started=started, errors=dict.fromkeys(failed, error))
        if self.kv_tiers is not None:  # before the finished requests' blocks are reused
            self.kv_tiers.store(
                filled_blocks(
                    scheduler_output, requests, runner_output.failed, self.info.block_size
                )
            )
        # Requests whose own sampling failed end here; their neighbours got their tokens.
        self.scheduler.finish_requests(list(runner_output.failed), RequestStatus.FINISHED_ERROR)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        return EngineCoreOutputs(
            timestamp=now, updates=tuple(updates), started=started, errors=runner_output.failed
        )

    def stats(self) -> CoreStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return CoreStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def kv_cache_report(self) -> KVCacheReport:
        return kv_cache_report(self.kv_cache_manager)

    def estimated_hit_rates(self) -> tuple[tuple[int, float], ...]:
        """The miss-ratio curve's gauges: (capacity in blocks, estimated LRU hit rate)."""
        curve = self.miss_ratio_curve
        return curve.point_hit_rates() if curve is not None else ()

    def miss_ratio_report(self) -> MissRatioReport:
        """The curve at 17 sizes around this cache's (engine/reports.py)."""
        return miss_ratio_report(self.kv_cache_manager, self.miss_ratio_curve)

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache (False while requests hold blocks); AllBlocksCleared is
        published at once rather than with the next step."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        self._publish_kv_events()
        return True

    def tier_stats(self) -> tuple[TierStats, ...]:
        return tier_stats(self.kv_tiers)

    def _publish_kv_events(self) -> None:
        batch = self.scheduler.take_kv_event_batch()
        tier_events = self.kv_tiers.take_events() if self.kv_tiers is not None else []
        if batch is None and tier_events:
            batch = KVEventBatch(ts=time.time(), events=[], data_parallel_rank=0)
        if batch is not None:
            batch.events.extend(tier_events)
            self.event_publisher.publish(batch)

    def shutdown(self) -> None:
        """Finish the tiers' queued writes, then close them, the event publisher and the
        runner's page mapping."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self._publish_kv_events()
        if self._kv_dir is not None:
            self._kv_dir.close()
        self.event_publisher.shutdown()
        self.runner.close()


def _context_length(config: EngineConfig, num_blocks: int, arch: Any) -> int:
    """The model's context, or `max_model_len`, within what the KV cache can hold: a request
    that could never fit would wait forever."""
    capacity = (num_blocks - 1) * config.cache.block_size
    wanted = config.model.max_model_len or arch.max_position_embeddings
    if wanted <= capacity:
        return int(wanted)
    if config.model.max_model_len is not None:
        raise InvalidConfigError(
            f"max_model_len {wanted} exceeds the KV cache, which holds {capacity} tokens; "
            "give the cache more memory or lower max_model_len"
        )
    logger.warning("the KV cache holds %d tokens: the context is capped there", capacity)
    return capacity
