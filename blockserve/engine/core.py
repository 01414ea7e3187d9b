"""`EngineCore`: the scheduler, the model runner and KV-event publishing, token ids in and out."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from blockserve.config import CacheConfig, EngineConfig
from blockserve.core.events import KVEventBatch, KVEventRecorder
from blockserve.core.eviction import TailLRUConfig
from blockserve.core.hashing import BlockHasher, BlockKeyInputs, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.cpu_threads import ThreadGovernor, plan_threads
from blockserve.engine.core_step import (
    ScheduledStep,
    advance_adapter_reads,
    finish_step,
    run_step,
    with_errors,
)
from blockserve.engine.outputs import (
    CoreStats,
    EngineCoreOutputs,
    KVCacheReport,
    MissRatioReport,
    TierStats,
)
from blockserve.engine.reports import kv_cache_report, miss_ratio_report
from blockserve.engine.request import EngineCoreRequest, SampleId
from blockserve.engine.tier_feed import create_kv_tiers, filled_blocks, tier_stats
from blockserve.events.publisher import create_event_publisher
from blockserve.runner.build import build_runner, capture_decode_graphs, warm_up_device
from blockserve.runner.kv_budget import LargestStep
from blockserve.runner.kv_cache import context_length
from blockserve.runner.launched import LaunchedStep
from blockserve.runner.page_mapping import blocks_per_step
from blockserve.sched.output import ModelRunnerOutput
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

_LOAD_WAIT_S = 0.05


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
        largest = LargestStep(sched.max_num_batched_tokens, sched.max_num_seqs)
        self.runner = build_runner(config.model, config.cache, per_step, largest, config.lora)
        loaded = self.runner.loaded
        max_model_len = context_length(
            config.model.max_model_len, loaded.arch, self.runner.num_blocks, config.cache.block_size
        )
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        warm_up_device(self.runner, max_model_len)  # nothing compiles once ready
        graphs = capture_decode_graphs(self.runner, config.model, sched.max_num_seqs, max_model_len)
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
        self.miss_ratio_curve = self._track_miss_ratio(cache)
        hasher = BlockHasher(cache.prefix_caching_hash_algo)
        self.block_hasher = RequestBlockHasher(hasher, cache.block_size)
        self.kv_tiers, self._kv_dir = create_kv_tiers(
            cache, self.runner, hasher, recorder.hash_format if recorder is not None else None
        )
        self._in_flight: tuple[ScheduledStep, LaunchedStep | Exception] | None = None  # async
        self.scheduler = Scheduler(
            config=self.scheduler_config,
            kv_cache_manager=self.kv_cache_manager,
            eos_token_ids=self.runner.eos_token_ids,
            tiers=self.kv_tiers,
            adapter_ready=self.runner.lora.ready if self.runner.lora is not None else None,
        )
        self.threads = _thread_governor(config.model.cpu_threads, self.runner.device)
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
                **({"threads": self.threads.threads} if self.threads is not None else {}),
                "compiled": self.runner.compile_report is not None,
                "cuda_graphs": 0 if graphs is None else len(graphs.sizes),
            },
        )

    def _track_miss_ratio(self, cache: CacheConfig) -> MissRatioCurve | None:
        """Gauges at 1/8x to 8x this cache, read after every step (O(1) each)."""
        if not (cache.enable_prefix_caching and cache.miss_ratio_samples):
            return None
        usable = self.runner.num_blocks - 1
        points = sorted({max(1, round(usable * 2.0**k)) for k in range(-3, 4)})
        curve = MissRatioCurve(cache.block_size, points, cache.miss_ratio_samples)
        self.kv_cache_manager.track_miss_ratio(curve)
        return curve

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer, for the front end to take at build time."""
        return self.runner.loaded.tokenizer

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated sample (the core trusts it)."""
        lora_path = ""
        if request.lora_name is not None:
            assert self.runner.lora is not None, "a LoRA request reaches only a LoRA engine"
            lora_path = self.runner.lora.hash_path(request.lora_name)
        keys = BlockKeyInputs(
            cache_salt=request.cache_salt, lora_name=request.lora_name, lora_path=lora_path
        )
        sample = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_hasher=self.block_hasher,
            hash_keys=keys,
            priority=request.priority,
        )
        sample.explain_cache = request.explain_cache
        if request.lora_name is not None and self.runner.lora is not None:
            sample.tier_identity = self.runner.lora.identity(request.lora_name)
        sample.group_id = request.group_id or request.request_id.request_id
        self.scheduler.add_request(sample)

    def abort_requests(self, request_ids: Iterable[SampleId]) -> None:
        """End samples now; their blocks are freed (and stay cached) before the next step."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, apply its tokens and publish the step's KV events."""
        unreadable = advance_adapter_reads(self.runner, self.scheduler)
        scheduled = self._schedule()
        if self.threads is not None:
            self.threads.before_step()
        if self.scheduler_config.async_scheduling:
            outputs = self._step_ahead(scheduled)
        else:
            outputs = self._apply(scheduled, run_step(self.runner.execute, scheduled))
        return with_errors(outputs, unreadable)

    def _step_ahead(self, scheduled: ScheduledStep) -> EngineCoreOutputs:
        """Async scheduling: launch this step, then finish and apply the one before it (the
        device runs this one meanwhile) and return its outputs (none on the first). A step
        whose samples need the token history of the one before finishes that one first."""
        previous, self._in_flight = self._in_flight, None
        done = None
        if previous is not None and not self.runner.can_launch_ahead(scheduled.output):
            done = finish_step(self.runner, previous[1])
        self._in_flight = (scheduled, run_step(self.runner.launch, scheduled))
        if previous is None:
            return EngineCoreOutputs(scheduled.now)
        return self._apply(
            previous[0], done if done is not None else finish_step(self.runner, previous[1])
        )

    def _schedule(self) -> ScheduledStep:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.kv_tiers is not None and self.scheduler.num_loading:
            self.kv_tiers.wait_for_loads(_LOAD_WAIT_S)  # nothing to run until a load is in
        elif scheduler_output.is_empty and self.runner.lora is not None:
            self.runner.lora.host.wait(_LOAD_WAIT_S)  # an adapter's read, if one is under way
        return ScheduledStep.of(scheduler_output, self.scheduler.requests)

    def _apply(
        self, scheduled: ScheduledStep, result: ModelRunnerOutput | Exception
    ) -> EngineCoreOutputs:
        """The step's tokens to the scheduler, its filled blocks to the tiers, its events out."""
        scheduler_output, now, started = scheduled.output, scheduled.now, scheduled.started
        if isinstance(result, Exception):
            failed = [s.request_id for s in scheduler_output.scheduled]
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
            # The error is the batch's, not any one request's: its text (which may quote
            # another request's input) stays in the log.
            error = f"the model step failed ({type(result).__name__}); the server log has details"
            return EngineCoreOutputs(now, started=started, errors=dict.fromkeys(failed, error))
        if self.kv_tiers is not None:  # before the finished requests' blocks are reused
            self.kv_tiers.store(
                filled_blocks(
                    scheduler_output, self.scheduler.requests, result.failed, self.info.block_size
                )
            )
        # Requests whose own sampling failed end here; their neighbours got their tokens.
        self.scheduler.finish_requests(list(result.failed), RequestStatus.FINISHED_ERROR)
        updates = self.scheduler.update_from_output(scheduler_output, result)
        self._publish_kv_events()
        return EngineCoreOutputs(
            timestamp=now, updates=tuple(updates), started=started, errors=result.failed
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
        """Finish the step in flight and the tiers' queued writes, then close the tiers, the
        event publisher and the runner's page mapping."""
        if self._in_flight is not None:
            finish_step(self.runner, self._in_flight[1])
            self._in_flight = None
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self._publish_kv_events()
        if self._kv_dir is not None:
            self._kv_dir.close()
        self.event_publisher.shutdown()
        self.runner.close()


def _thread_governor(cpu_threads: int | None, device: torch.device) -> ThreadGovernor | None:
    """On a CPU, what sets the compute threads before each step (cpu_threads.py)."""
    if device.type != "cpu":
        return None
    affinity = frozenset(os.sched_getaffinity(0))
    return ThreadGovernor(plan_threads(cpu_threads, os.environ, affinity, torch.get_num_threads()))
