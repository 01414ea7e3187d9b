"""The continuous-batching scheduler. Owns the waiting queue, the running list and the per-step
token budget; decides which requests compute how many tokens each step, preempts when the KV
cache is full, applies the stop conditions that need no text, and drains the step's KV events.
Imports no torch."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from blockserve.config import SchedulerConfig
from blockserve.core.events import KVEventBatch
from blockserve.core.kv_cache_manager import KVCacheManager, RequestId
from blockserve.sched.batch import batch_for_runner
from blockserve.sched.encoder_cache import EncoderCacheManager, allocate_planned, plan_images
from blockserve.sched.fair_share import FairShare
from blockserve.sched.output import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from blockserve.sched.queues import create_request_queue, priority_key
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.stops import check_stop
from blockserve.sched.tier_loads import TierLoader, TierLoads


class Scheduler:
    """Decides each step's batch (docs/behaviour.md §4 states the rules it implements).

    Step order: running requests first, in admission order, each taking `min(remaining,
    budget)` tokens; if one cannot get blocks, a victim is preempted (FCFS: the most recently
    admitted; priority: the largest `(priority, arrival_time)`), possibly itself. Waiting
    requests are admitted only if nothing was preempted this step, while budget remains and
    fewer than `max_num_seqs` run; admission stops at the first request that does not fit.

    With `tiers`, a request whose prefix continues in a lower tier is admitted LOADING: it
    holds its blocks, takes no token budget, and joins the running list once its load ends.

    With `encoder_cache` (a vision-language model), a step encodes the images its tokens reach
    that the cache does not hold, within `encoder_budget` embeddings; a request stops before
    an image that does not fit (sched/encoder_cache.py).

    There are no prefill/decode phases: every request has `num_computed_tokens` catching up to
    `num_tokens` under the token budget, which gives chunked prefill and prefix-cache skips.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: tuple[int, ...] = (),
        tiers: TierLoader | None = None,
        adapter_ready: Callable[[str], bool] | None = None,
        encoder_cache: EncoderCacheManager | None = None,
        encoder_budget: int = 0,
    ) -> None:
        self.config = config
        self._adapter_ready = adapter_ready  # LoRA: an adapter can run now (else it is read in)
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = create_request_queue(config, kv_cache_manager)
        self.fair_share = FairShare(config.max_num_seqs, config.max_request_seq_share)
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.finished_request_ids: set[RequestId] = set()
        self.num_preemptions = 0
        self.loads = TierLoads(tiers, kv_cache_manager) if tiers is not None else None
        # Requests that finished loading and have not yet been sent to the runner.
        self._loaded: set[RequestId] = set()
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget
        self._encode: dict[RequestId, tuple[int, ...]] = {}  # this step's images to encode
        self._encoder_left = encoder_budget  # this step's encoder budget left, in embeddings

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. It was validated above (engine/input_processor.py): its id is
        unused, its priority allowed by the policy and its prompt within the context."""
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[RequestId], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, stop string): free their blocks now."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.LOADING:
                assert self.loads is not None
                self.loads.cancel(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(request.request_id, request.images)
        self.finished_request_ids.add(request.request_id)
        self._loaded.discard(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_loading(self) -> int:
        return len(self.loads) if self.loads is not None else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and allocate its KV blocks."""
        num_scheduled: dict[RequestId, int] = {}
        self._encode, self._encoder_left = {}, self.encoder_budget
        if self.loads is not None:
            for request in self.loads.finish():  # loaded: they run, sent to the runner anew
                self.running.append(request)
                self._loaded.add(request.request_id)
        loading = self.loads.requests() if self.loads is not None else ()
        held = self.fair_share.held_by(self.running, loading)  # slots per group, this step
        victim = self.fair_share.victim(self.waiting, self.running, held)
        if victim is not None:  # its slot goes to a request waiting under its share
            self._preempt(victim)
            held[victim.group_id] -= 1
        budget, preempted_any = self._schedule_running(num_scheduled)
        # No admission after a preemption: the freed blocks go to the preempted first.
        new_request_ids = set() if preempted_any else self._admit(budget, num_scheduled, held)
        return self._build_output(num_scheduled, new_request_ids)

    def _schedule_running(self, num_scheduled: dict[RequestId, int]) -> tuple[int, bool]:
        """Give each running request its tokens, preempting when blocks run out; returns the
        budget left and whether anything was preempted."""
        budget = self.config.max_num_batched_tokens
        preempted_any = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            limit = request.chunk_limit(budget, self.config.max_scored_tokens_per_step)
            num_new = min(request.num_tokens_ahead - request.num_computed_tokens, limit)
            if num_new <= 0 or request.stops_in_flight(self.config.max_model_len):
                index += 1  # its next token is in flight (async scheduling)
                continue
            num_new, encode = self._plan_images(request, request.num_computed_tokens, num_new)
            if num_new <= 0:  # an image it reaches cannot be encoded this step
                index += 1
                continue
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                preempted_any = True
                # A victim already scheduled this step gives its tokens back.
                budget += num_scheduled.pop(victim.request_id, 0)
                self._encode.pop(victim.request_id, None)
                self._preempt(victim)
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
            else:
                num_scheduled[request.request_id] = num_new
                self._allocate_images(request, encode)
                budget -= num_new
                index += 1
        return budget, preempted_any

    def _admit(
        self, budget: int, num_scheduled: dict[RequestId, int], held: Counter[str]
    ) -> set[RequestId]:
        """Admit waiting requests in queue order (fair share aside: `held` counts each group's
        slots) while they fit; returns the admitted ids."""
        new_request_ids: set[RequestId] = set()
        adapters: set[str] = set()
        if self.config.max_loras:  # LoRA on: the adapters the running requests hold slots for
            adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        while (
            self.waiting
            and budget > 0
            and len(self.running) + self.num_loading < self.config.max_num_seqs
        ):
            head = self.waiting.peek()
            request = self.fair_share.next_to_admit(head, self.waiting, held)
            if not self._adapter_fits(request, adapters):
                # Its adapter needs a slot the running ones hold, or is being read in: the first
                # request behind it whose adapter fits goes instead; it keeps its place.
                fits = (r for r in self.waiting if self._adapter_fits(r, adapters))
                behind: Request | None = next(fits, None)
                if behind is None:
                    break
                request = behind
            if request.lora_name is not None:
                adapters.add(request.lora_name)
            hit_blocks, num_hits = self.kv_cache_manager.get_computed_blocks(request)
            tier_hits = (
                self.loads.lookup(request, len(hit_blocks)) if self.loads is not None else []
            )
            if tier_hits:  # admitted LOADING: it takes no budget until its blocks are in
                assert self.loads is not None
                if not self.loads.start(request, hit_blocks, tier_hits):
                    break  # strict head-of-line, as below
                self._take_waiting(request, head)
                held[request.group_id] += 1
                continue
            first_admission = request.num_cached_tokens is None
            # Explained before allocating, which stores the request's own blocks.
            explanation = (
                self.kv_cache_manager.explain(request, num_hits)
                if first_admission and request.explain_cache
                else None
            )
            limit = request.chunk_limit(budget, self.config.max_scored_tokens_per_step)
            num_new, encode = self._plan_images(
                request, num_hits, min(request.num_tokens - num_hits, limit)
            )
            if num_new <= 0 or (
                self.kv_cache_manager.allocate_slots(request, num_new, num_hits, hit_blocks) is None
            ):
                self._release_images(request)
                break  # strict head-of-line: nothing behind it jumps ahead
            self._take_waiting(request, head)
            held[request.group_id] += 1
            request.num_computed_tokens = num_hits
            if first_admission:
                request.num_cached_tokens = num_hits
                request.cache_explanation = explanation
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            self._allocate_images(request, encode)
            new_request_ids.add(request.request_id)
            budget -= num_new
        return new_request_ids

    def _adapter_fits(self, request: Request, adapters: set[str]) -> bool:
        """Whether the step can hold `request`'s LoRA adapter beside `adapters`, and the
        adapter is in memory (asked only of one that fits, so only it is read in)."""
        if (name := request.lora_name) is None:
            return True
        fits = name in adapters or len(adapters) < self.config.max_loras
        return fits and (self._adapter_ready is None or self._adapter_ready(name))

    def _take_waiting(self, request: Request, head: Request) -> None:
        if request is head:
            self.waiting.pop()
        else:  # passed the head by for its group's fair share
            self.waiting.remove(request)

    # -- images (a vision-language model's) -----------------------------------------------

    def _plan_images(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """`num_new` cut before the first image the step cannot encode, and the images it
        will encode (their references taken; see encoder_cache.plan_images)."""
        if self.encoder_cache is None or not request.images:
            return num_new, []
        num_new, encode, num_embeds = plan_images(
            self.encoder_cache,
            request.request_id,
            request.images,
            start,
            num_new,
            self._encoder_left,
        )
        self._encoder_left -= num_embeds
        return num_new, encode

    def _allocate_images(self, request: Request, encode: list[int]) -> None:
        """The step computes `request`'s tokens: its images to encode join the cache."""
        if self.encoder_cache is not None and encode:
            allocate_planned(self.encoder_cache, request.request_id, request.images, encode)
            self._encode[request.request_id] = tuple(encode)

    def _release_images(self, request: Request) -> None:
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(request.request_id, request.images)

    def _release_computed_images(self, request: Request) -> None:
        """Images whose whole span is in the KV cache are no longer needed by `request`."""
        assert self.encoder_cache is not None
        for index in self.encoder_cache.inputs_of(request.request_id):
            image = request.images[index]
            if image.offset + image.length <= request.num_computed_tokens:
                self.encoder_cache.release(request.request_id, index, request.images)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: blocks freed (they stay cached), computed tokens reset."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self._release_images(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _build_output(
        self, num_scheduled: dict[RequestId, int], new_ids: set[RequestId]
    ) -> SchedulerOutput:
        first_sent = new_ids | self._loaded
        self._loaded -= first_sent
        scheduled = batch_for_runner(
            self.running,
            num_scheduled,
            first_sent,
            self.kv_cache_manager,
            ahead=self.config.async_scheduling,
        )
        output = SchedulerOutput(
            scheduled,
            frozenset(self.finished_request_ids),
            encoder_inputs=tuple(
                (request_id, index)
                for request_id, indices in self._encode.items()
                for index in indices
            ),
            freed_encoder_ids=() if self.encoder_cache is None else self.encoder_cache.take_freed(),
        )
        self.finished_request_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        updates = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            token_id = runner_output.sampled_token_ids.get(scheduled.request_id)
            if request is not None and request.images and self.encoder_cache is not None:
                self._release_computed_images(request)
            if request is None or request.is_finished or token_id is None:
                continue  # under async scheduling: a token past the request's end is dropped
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            request.append_output_token_ids(token_id)
            status = check_stop(request, token_id, self.eos_token_ids, self.config.max_model_len)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:  # preempted while its token was in flight (async scheduling)
                    self.waiting.remove(request)
                self._finish(request, status)
            updates.append(
                RequestUpdate(
                    request_id=request.request_id,
                    new_token_ids=(token_id,),
                    status=request.status,
                    logprobs=runner_output.logprobs.get(request.request_id),
                    prompt_logprobs=runner_output.prompt_logprobs.get(request.request_id),
                    stop_reason=request.stop_reason,
                )
            )
        return updates

    def take_kv_event_batch(self) -> KVEventBatch | None:
        """The step's KV events as one batch, or None when the step produced none."""
        events = self.kv_cache_manager.take_events()
        if not events:
            return None
        return KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
