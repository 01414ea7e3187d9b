"""`EngineCore`: the scheduler, the model runner and KV-event publishing, token ids in and out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from blockserve.config import CacheConfig, EngineConfig
from blockserve.core.events import KVEventBatch, KVEventRecorder
from blockserve.core.hashing import (
    BlockHasher,
    BlockKeyInputs,
    MultiModalFeature,
    RequestBlockHasher,
)
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.cpu_threads import ThreadGovernor, host_thread_plan
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
from blockserve.events.config import KVEventsConfig
from blockserve.events.publisher import create_event_publisher
from blockserve.model.tokenizer import Tokenizer
from blockserve.runner.start import LaunchedStep, RunnerInfo, start_runner
from blockserve.sched.encoder_cache import encoder_cache_for
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

    @classmethod
    def of(cls, runner: RunnerInfo, threads: ThreadGovernor | None) -> CoreInfo:
        return cls(
            model_name=runner.model_name,
            model_path=str(runner.model_dir),
            dtype=str(runner.dtype).removeprefix("torch."),
            max_model_len=runner.max_model_len,
            vocab_size=runner.arch.vocab_size,
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            runtime={
                **runner.runtime,
                **({"threads": threads.threads} if threads is not None else {}),
            },
        )


class EngineCore:
    """Add requests, call `step()` while `has_unfinished_requests()`; abort at any time.

    Owns the one step loop body: schedule, run the model, update the scheduler, publish the
    step's KV events. Knows no text, no `n` and no HTTP: its surface is plain data
    (`EngineCoreRequest` in, `EngineCoreOutputs` out), so it could run in a process of its own.
    A failing model step fails the requests in it, never the core.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.runner, info = start_runner(config)  # steps in, outputs out
        self.runner_info, self.lora, cache = info, info.lora, config.cache
        self.scheduler_config = replace(config.scheduler, max_model_len=info.max_model_len)
        self.event_publisher = create_event_publisher(config.kv_events)
        recorder = _event_recorder(config.kv_events)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=info.num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            events=recorder,
            eviction=cache.eviction,
        )
        self.miss_ratio_curve = self._track_miss_ratio(cache)
        hasher = BlockHasher(cache.prefix_caching_hash_algo)
        self.block_hasher = RequestBlockHasher(hasher, cache.block_size)
        self.kv_tiers, self._kv_dir = create_kv_tiers(
            cache, self.runner_info, hasher, recorder.hash_format if recorder else None
        )
        self._in_flight: tuple[ScheduledStep, LaunchedStep | Exception] | None = None  # async
        encoder_cache, encoder_budget = None, 0
        if info.images is not None:
            encoder_cache, encoder_budget = encoder_cache_for(
                info.images.max_embeds,
                self.scheduler_config.max_num_batched_tokens,
                self.scheduler_config.encoder_cache_size,
            )
        self.scheduler = Scheduler(
            config=self.scheduler_config,
            kv_cache_manager=self.kv_cache_manager,
            eos_token_ids=info.arch.eos_token_ids,
            tiers=self.kv_tiers,
            adapter_ready=self.lora.ready if self.lora is not None else None,
            encoder_cache=encoder_cache,
            encoder_budget=encoder_budget,
        )
        self.threads = _thread_governor(config, info)
        self.info = CoreInfo.of(info, self.threads)

    def _track_miss_ratio(self, cache: CacheConfig) -> MissRatioCurve | None:
        """Gauges at 1/8x to 8x this cache, read after every step (O(1) each)."""
        if not (cache.enable_prefix_caching and cache.miss_ratio_samples):
            return None
        usable = self.runner_info.num_blocks - 1
        points = sorted({max(1, round(usable * 2.0**k)) for k in range(-3, 4)})
        curve = MissRatioCurve(cache.block_size, points, cache.miss_ratio_samples)
        self.kv_cache_manager.track_miss_ratio(curve)
        return curve

    @property
    def tokenizer(self) -> Tokenizer:
        """The loaded model's tokenizer, for the front end to take at build time."""
        return self.runner_info.tokenizer

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated sample (the core trusts it)."""
        lora_path = ""
        if request.lora_name is not None:
            assert self.lora is not None, "a LoRA request reaches only a LoRA engine"
            lora_path = self.lora.hash_path(request.lora_name)
        keys = BlockKeyInputs(
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            lora_path=lora_path,
            mm_features=tuple(
                MultiModalFeature(image.identifier, image.offset, image.length)
                for image in request.images
            ),
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
        if request.lora_name is not None and self.lora is not None:
            sample.tier_identity = self.lora.identity(request.lora_name)
        sample.group_id = request.group_id or request.request_id.request_id
        if request.images:
            self.runner.add_images(request.request_id, request.images)
            sample.images = request.images
        self.scheduler.add_request(sample)

    def abort_requests(self, request_ids: Iterable[SampleId]) -> None:
        """End samples now; their blocks are freed (and stay cached) before the next step."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, apply its tokens and publish the step's KV events."""
        unreadable = advance_adapter_reads(self.lora, self.scheduler)
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
        elif scheduler_output.is_empty and self.lora is not None:
            self.lora.host.wait(_LOAD_WAIT_S)  # an adapter's read, if one is under way
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


def _event_recorder(events: KVEventsConfig | None) -> KVEventRecorder | None:
    """What records the cache's KV events, where they are published."""
    if events is None or not events.enabled:
        return None
    return KVEventRecorder(hash_format=events.hash_format)  # type: ignore[arg-type]


def _thread_governor(config: EngineConfig, runner: RunnerInfo) -> ThreadGovernor | None:
    """On a CPU, what sets the compute threads before each step (cpu_threads.py)."""
    if not runner.on_cpu:
        return None
    runtime = config.runtime
    return ThreadGovernor(runtime.threads or host_thread_plan(runtime.cpu_threads))
