"""`OutputProcessor`: from the core's token updates to `RequestOutput`s."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from blockserve.core.explain import CacheExplanation
from blockserve.core.kv_cache_manager import RequestId
from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.engine.outputs import (
    CompletionOutput,
    EngineCoreOutputs,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from blockserve.engine.request import EngineCoreRequest, SampleId, ValidatedRequest
from blockserve.sched.output import RequestUpdate, TokenLogprobs


@dataclass
class _Sample:
    """One of a request's `n` samples."""

    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request: ValidatedRequest
    samples: list[_Sample]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int | None = None
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    cache_explanation: CacheExplanation | None = None
    error: str | None = None
    # prompt_logprobs: None at the first position (nothing predicts it), then each token's
    prompt_logprobs: tuple[Logprob | None, ...] | None = None
    # Samples 1..n-1 of a request with prompt logprobs, held until sample 0 has computed the
    # prompt (they then read its blocks from the cache and compute no prompt logprobs).
    deferred: list[EngineCoreRequest] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def finish(self, reason: str, now: float) -> list[SampleId]:
        """Finish the unfinished samples with `reason`; their ids, for the core to abort."""
        ended = [i for i, s in enumerate(self.samples) if s.finish_reason is None]
        for index in ended:
            self.samples[index].finish_reason = reason
        self.finished_time = now
        return [SampleId(self.request.request_id, index) for index in ended]


@dataclass(frozen=True, slots=True)
class ProcessedOutputs:
    """A step's outputs, and the samples the core must still abort: ended by a stop string,
    by an abort, or as siblings of a sample that failed."""

    request_outputs: list[RequestOutput]
    samples_to_abort: list[SampleId]
    # Samples held back until a sibling computed their shared prompt: the core runs them now.
    samples_to_add: list[EngineCoreRequest] = field(default_factory=list)


class OutputProcessor:
    """Tracks every live request; `in` tells whether a request id is live.

    Owns everything per request above the core: fanning a request out into its `n` samples and
    back in, incremental detokenization and stop strings, the request's timing and token
    counters. It never calls the core: samples that a stop string ends are handed back for the
    caller to abort. Runs on the engine's thread.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def add_request(self, request: ValidatedRequest) -> list[EngineCoreRequest]:
        """Track a request; returns its samples, for the core to run now.

        With prompt logprobs (echo scoring too) and n > 1 only sample 0 runs at first: the
        prompt's logprobs are every choice's, so they are computed once, and the other samples
        start (from `process`'s `samples_to_add`) once sample 0's prompt is in the cache."""
        spec, prompt_ids = request.spec, request.prompt_token_ids
        params = spec.params
        samples = [
            _Sample(
                IncrementalDetokenizer(self.tokenizer, params, list(prompt_ids)),
                logprobs=[] if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        state = _RequestState(request, samples, time.monotonic())
        self._requests[spec.request_id] = state
        core_requests = [
            EngineCoreRequest(
                SampleId(spec.request_id, index),
                prompt_ids,
                dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + index
                ),
                priority=spec.priority,
                cache_salt=spec.cache_salt,
                lora_name=spec.lora_name,
                explain_cache=spec.explain_cache,
                group_id=spec.group_id or spec.request_id,
                images=request.images,
            )
            for index in range(params.n)
        ]
        if params.prompt_logprobs is None or params.n == 1:
            return core_requests
        state.deferred = [
            dataclasses.replace(
                r, sampling_params=dataclasses.replace(r.sampling_params, prompt_logprobs=None)
            )
            for r in core_requests[1:]
        ]
        return core_requests[:1]

    def abort(self, request_ids: Iterable[str]) -> ProcessedOutputs:
        """End requests now: their final outputs, and their samples for the core to abort."""
        outputs, to_abort = [], []
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is not None:
                to_abort += state.finish("abort", time.monotonic())
                outputs.append(self._output(state))
        return ProcessedOutputs(outputs, to_abort)

    def process(
        self, core_outputs: EngineCoreOutputs, final_only: bool = False
    ) -> ProcessedOutputs:
        """Apply one step: an output for every request it changed (`final_only`: for every
        request it finished; the others' are not built)."""
        for core_id, num_cached_tokens, explanation, per_tier in core_outputs.started:
            state = self._state_of(core_id)
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = core_outputs.timestamp
                state.num_cached_tokens = num_cached_tokens
                state.tier_cached_tokens = per_tier
                state.cache_explanation = explanation
        touched: dict[str, _RequestState] = {}
        to_abort: list[SampleId] = []
        to_add: list[EngineCoreRequest] = []
        for core_id, error in core_outputs.errors.items():
            state = self._state_of(core_id)
            if state is not None:
                state.error = error
                # The core ended the samples in the failed step; their siblings end too.
                to_abort += state.finish("error", time.monotonic())
                touched[state.request.request_id] = state
        for update in core_outputs.updates:
            state = self._state_of(update.request_id)
            if state is None:
                continue
            sample_id = cast(SampleId, update.request_id)
            if self._apply_update(state, sample_id.sample_index, update):
                to_abort.append(sample_id)
            touched[sample_id.request_id] = state
            if state.deferred and not state.finished:  # sample 0 has computed the prompt
                to_add += state.deferred
                state.deferred = []
        outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished or not final_only:
                outputs.append(self._output(state))
            if finished:
                del self._requests[request_id]
        return ProcessedOutputs(outputs, to_abort, to_add)

    def _state_of(self, core_id: RequestId) -> _RequestState | None:
        """The live request a core id (a `SampleId`) belongs to; None once it has ended."""
        return self._requests.get(cast(SampleId, core_id).request_id)

    def _apply_update(self, state: _RequestState, index: int, update: RequestUpdate) -> bool:
        """Record one sample's new tokens; True when a stop string ended it here."""
        now = time.monotonic()
        sample = state.samples[index]
        if state.first_token_time is None:
            state.first_token_time = now
            self.num_prompt_tokens += len(state.request.prompt_token_ids)
        self.num_generation_tokens += len(update.new_token_ids)
        sample.token_ids.extend(update.new_token_ids)
        if sample.logprobs is not None and update.logprobs is not None:
            sample.logprobs.append(_logprob(update.logprobs))
        if update.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = (None, *map(_logprob, update.prompt_logprobs))
        stop = sample.detokenizer.update(list(update.new_token_ids))
        stopped_here = stop is not None and not update.status.is_finished
        if stopped_here:
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif update.status.is_finished:
            sample.finish_reason = update.status.finish_reason
            sample.stop_reason = stop if stop is not None else update.stop_reason
        if sample.finish_reason is not None and state.finished:
            state.finished_time = now
        return stopped_here

    def _output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt_text,
            prompt_token_ids=request.prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens or 0,
            tier_cached_tokens=state.tier_cached_tokens,
            outputs=tuple(
                CompletionOutput(
                    index=index,
                    text=s.detokenizer.visible_text(s.finish_reason is not None),
                    token_ids=tuple(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=None if s.logprobs is None else tuple(s.logprobs),
                )
                for index, s in enumerate(state.samples)
            ),
            finished=state.finished,
            metrics=RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=state.first_scheduled_time,
                first_token_time=state.first_token_time,
                finished_time=state.finished_time,
            ),
            error=state.error,
            cache_explanation=state.cache_explanation,
            prompt_logprobs=state.prompt_logprobs,
        )


def _logprob(lp: TokenLogprobs) -> Logprob:
    return Logprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=dict(lp.top))
