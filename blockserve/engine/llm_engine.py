"""`LLMEngine`: the synchronous step loop that joins scheduler, runner and detokenizer.

Owns request bookkeeping above the scheduler: tokenizing prompts, splitting `n > 1` into
samples, detokenizing with stop strings, timing metrics, and turning each step into
`RequestOutput`s. A failure while handling one request ends that request, not the engine.
Speaks no HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from blockserve.config import CacheConfig, ModelConfig, SchedulerConfig
from blockserve.core.events import KVEventRecorder
from blockserve.core.hashing import BlockHasher, BlockKeyInputs, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from blockserve.errors import InvalidConfigError, InvalidRequestError
from blockserve.events.config import KVEventsConfig
from blockserve.events.publisher import EventPublisher, create_event_publisher
from blockserve.runner.model_runner import ModelRunner
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import ScheduledRequest
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class _Sample:
    """One of a request's `n` samples (a scheduler request of its own)."""

    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    samples: list[_Sample]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class LLMEngine:
    """Add requests, call `step()` until `has_unfinished_requests()` is False."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig | None = None,
        kv_events_config: KVEventsConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.runner = ModelRunner(model_config, cache_config)
        self.tokenizer: Any = self.runner.loaded.tokenizer
        self.model_name = self.runner.loaded.name
        self.max_model_len = self._context_length(model_config, cache_config.block_size)
        self.scheduler_config = dataclasses.replace(
            scheduler_config or SchedulerConfig(), max_model_len=self.max_model_len
        )
        self.event_publisher: EventPublisher = create_event_publisher(kv_events_config)
        recorder = None
        if kv_events_config is not None and kv_events_config.enabled:
            recorder = KVEventRecorder(hash_format=kv_events_config.hash_format)  # type: ignore[arg-type]
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            recorder,
            cache_config.eviction_policy,
        )
        self.block_hasher = RequestBlockHasher(
            BlockHasher(cache_config.prefix_caching_hash_algo), cache_config.block_size
        )
        self.scheduler = Scheduler(
            self.scheduler_config, self.kv_cache_manager, self.runner.eos_token_ids
        )
        self.vocab_size = self.runner.arch.vocab_size
        self._requests: dict[str, _RequestState] = {}
        self._sample_owner: dict[str, tuple[_RequestState, _Sample]] = {}
        self._pending_outputs: list[RequestOutput] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def _context_length(self, model_config: ModelConfig, block_size: int) -> int:
        """The model's context, or `max_model_len`, within what the KV cache can hold: a
        request that could never fit would wait forever."""
        capacity = (self.runner.num_blocks - 1) * block_size
        wanted = model_config.max_model_len or self.runner.arch.max_position_embeddings
        if wanted <= capacity:
            return wanted
        if model_config.max_model_len is not None:
            raise InvalidConfigError(
                f"max_model_len {wanted} exceeds the KV cache, which holds {capacity} tokens; "
                "give the cache more memory or lower max_model_len"
            )
        logger.warning("the KV cache holds %d tokens: the context is capped there", capacity)
        return capacity

    # -- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; token-id prompts are checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return list(self.tokenizer.encode(prompt))
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is out of range for a vocabulary of {self.vocab_size}"
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Validate, tokenize and queue a request; InvalidRequestError changes nothing."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the context is "
                f"{self.max_model_len} tokens and one must be left to generate"
            )
        if params.prompt_logprobs is not None:
            # The scheduler already keeps such requests off the cache (they need every
            # position's logits); the runner does not compute prompt logprobs yet.
            raise InvalidRequestError("prompt_logprobs are not supported yet")
        if priority != 0 and self.scheduler_config.policy == "fcfs":
            raise InvalidRequestError(
                "priority is only supported with --scheduling-policy priority"
            )
        keys = BlockKeyInputs(cache_salt=cache_salt)
        sample_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        taken = [s for s in sample_ids if s in self._sample_owner]
        if taken:  # checked before anything is queued, so a refusal leaves no half request
            raise InvalidRequestError(f"request id {taken[0]!r} is already in use")
        requests = []
        for index, sample_id in enumerate(sample_ids):
            seed = None if params.seed is None else params.seed + index
            sample_params = dataclasses.replace(params, n=1, seed=seed)
            requests.append(
                Request(sample_id, token_ids, sample_params, self.block_hasher, keys, priority)
            )
        state = _RequestState(
            request_id,
            prompt if isinstance(prompt, str) else None,
            tuple(token_ids),
            [
                _Sample(
                    i,
                    r.request_id,
                    IncrementalDetokenizer(self.tokenizer, params, token_ids),
                    logprobs=[] if params.logprobs is not None else None,
                )
                for i, r in enumerate(requests)
            ],
            arrival_time=time.monotonic(),
        )
        for request in requests:
            self.scheduler.add_request(request)
        self._requests[request_id] = state
        for sample in state.samples:
            self._sample_owner[sample.request_id] = (state, sample)

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """End requests now; their blocks are freed (and stay cached) before the next step."""
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is None:
                continue
            self._finish_samples(state, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(self._output(state))
            self._forget(state)

    def abort_all(self) -> None:
        self.abort_request(list(self._requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, and return an output for every request that changed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduler_output = self.scheduler.schedule()
        now = time.monotonic()
        for scheduled in scheduler_output.scheduled:
            state, _ = self._sample_owner[scheduled.request_id]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now
            if state.num_cached_tokens is None and scheduled.new_request is not None:
                state.num_cached_tokens = scheduled.num_computed_tokens
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:  # the batch fails; the engine goes on
            logger.exception(
                "model step failed; failing the %d requests in it", len(scheduler_output.scheduled)
            )
            return outputs + self._fail_step(scheduler_output.scheduled, exc)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        touched: dict[str, _RequestState] = {}
        for update in updates:
            state, sample = self._sample_owner[update.request_id]
            try:
                self._apply_update(state, sample, update)
            except Exception as exc:  # one request's failure ends that request only
                logger.exception("request %s failed", state.request_id)
                state.error = f"{type(exc).__name__}: {exc}"
                self._finish_samples(state, RequestStatus.FINISHED_ERROR)
            touched[state.request_id] = state
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                self._forget(state)
        return outputs

    def _apply_update(self, state: _RequestState, sample: _Sample, update: RequestUpdate) -> None:
        now = time.monotonic()
        if state.first_token_time is None:
            state.first_token_time = now
            self.num_prompt_tokens += len(state.prompt_token_ids)
        self.num_generation_tokens += len(update.new_token_ids)
        sample.token_ids.extend(update.new_token_ids)
        if sample.logprobs is not None and update.logprobs is not None:
            lp = update.logprobs
            sample.logprobs.append(Logprob(lp.token_id, lp.logprob, lp.rank, dict(lp.top)))
        stop = sample.detokenizer.update(list(update.new_token_ids))
        if stop is not None and not update.status.is_finished:
            self.scheduler.finish_requests([sample.request_id], RequestStatus.FINISHED_STOPPED)
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif update.status.is_finished:
            sample.finish_reason = update.status.finish_reason
            sample.stop_reason = stop if stop is not None else update.stop_reason
        if state.finished:
            state.finished_time = now

    def _finish_samples(self, state: _RequestState, status: RequestStatus) -> None:
        unfinished = [s for s in state.samples if s.finish_reason is None]
        self.scheduler.finish_requests([s.request_id for s in unfinished], status)
        for sample in unfinished:
            sample.finish_reason = status.finish_reason
        state.finished_time = time.monotonic()

    def _fail_step(
        self, scheduled: Sequence[ScheduledRequest], exc: Exception
    ) -> list[RequestOutput]:
        failed: dict[str, _RequestState] = {}
        for item in scheduled:
            state, _ = self._sample_owner[item.request_id]
            state.error = f"{type(exc).__name__}: {exc}"
            failed[state.request_id] = state
        outputs = []
        for state in failed.values():
            self._finish_samples(state, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(state))
            self._forget(state)
        return outputs

    def _forget(self, state: _RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for sample in state.samples:
            self._sample_owner.pop(sample.request_id, None)

    def _output(self, state: _RequestState) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens or 0,
            outputs=tuple(
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.visible_text(s.finish_reason is not None),
                    token_ids=tuple(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=None if s.logprobs is None else tuple(s.logprobs),
                )
                for s in state.samples
            ),
            finished=state.finished,
            metrics=RequestMetrics(
                state.arrival_time,
                state.first_scheduled_time,
                state.first_token_time,
                state.finished_time,
            ),
            error=state.error,
        )

    # -- introspection ------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache (False while requests hold blocks); AllBlocksCleared is
        published at once rather than with the next step."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        self._publish_kv_events()
        return True

    def _publish_kv_events(self) -> None:
        batch = self.scheduler.take_kv_event_batch()
        if batch is not None:
            self.event_publisher.publish(batch)

    def shutdown(self) -> None:
        self.event_publisher.shutdown()
