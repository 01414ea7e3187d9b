"""What the runner remembers of each running request between steps (its token history, its
seeded generator, its grammar matcher), what a step takes from it (the tokens sent as
placeholders, each sampling row) and what it adds (the sampled tokens)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import llguidance
import torch

from blockserve.core.kv_cache_manager import RequestId
from blockserve.grammar import GrammarCompiler
from blockserve.model.sampler import SamplerOutput, SamplingRow
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)


@dataclass
class RequestState:
    """What the runner remembers of a running request between steps."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = field(default=None, repr=False)
    # The structured-outputs matcher, advanced with every sampled token; or why it failed.
    matcher: llguidance.LLMatcher | None = field(default=None, repr=False)
    grammar_error: str | None = None
    lora_name: str | None = None  # the adapter it runs under
    # prompt_logprobs: positions 0.. of the prompt computed so far (runner/prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)


class RequestStates:
    """The running requests' states by id: added when a request is first sent, dropped when
    the scheduler reports it finished."""

    def __init__(self, device: torch.device, grammar: GrammarCompiler) -> None:
        self.device = device
        self.grammar = grammar
        self.states: dict[RequestId, RequestState] = {}
        # The requests that asked for prompt_logprobs: a step without one looks at no row.
        self.asking_prompt_logprobs: set[RequestId] = set()

    def __getitem__(self, request_id: RequestId) -> RequestState:
        return self.states[request_id]

    def lora_of(self, request_id: RequestId) -> str | None:
        return self.states[request_id].lora_name

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
            self.asking_prompt_logprobs.discard(request_id)
        for scheduled in scheduler_output.scheduled:
            new = scheduled.new_request
            if new is None:
                continue
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            state = RequestState(
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                params=new.sampling_params,
                generator=generator,
                lora_name=new.lora_name,
            )
            constraint = new.sampling_params.structured_outputs
            if constraint is not None:
                try:
                    state.matcher = self.grammar.matcher(constraint, state.output_token_ids)
                except Exception as exc:  # fails this sample when it samples, no other
                    state.grammar_error = f"{type(exc).__name__}: {exc}"
            self.states[scheduled.request_id] = state
            if new.sampling_params.prompt_logprobs is not None:
                self.asking_prompt_logprobs.add(scheduled.request_id)

    def fill_placeholders(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """Async scheduling sends a token the previous step sampled as PLACEHOLDER_TOKEN; that
        step ran before this one, so the token ends the request's history here."""
        scheduled = list(scheduler_output.scheduled)
        filled = False
        for index, request in enumerate(scheduled):
            if request.token_ids[-1] != PLACEHOLDER_TOKEN:
                continue
            count = request.token_ids.count(PLACEHOLDER_TOKEN)
            latest = self.states[request.request_id].output_token_ids[-count:]
            # Shorter only when the step before failed for it: its output will be dropped.
            latest = [*(0,) * (count - len(latest)), *latest]
            token_ids = (*request.token_ids[:-count], *latest)
            scheduled[index] = dataclasses.replace(request, token_ids=token_ids)
            filled = True
        if not filled:
            return scheduler_output
        return dataclasses.replace(scheduler_output, scheduled=tuple(scheduled))

    def sampling_rows(
        self, scheduler_output: SchedulerOutput, eos_token_ids: tuple[int, ...]
    ) -> list[SamplingRow]:
        rows = []
        for scheduled in scheduler_output.scheduled:
            if not scheduled.sample:
                continue
            state = self.states[scheduled.request_id]
            banned: tuple[int, ...] = ()
            if len(state.output_token_ids) < state.params.min_tokens:
                # Stopping is not allowed yet, so neither are the tokens that would stop.
                banned = (*eos_token_ids, *state.params.stop_token_ids)
            rows.append(
                SamplingRow(
                    params=state.params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.output_token_ids,
                    generator=state.generator,
                    banned_token_ids=banned,
                )
            )
        return rows

    def history_bound(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a sample of the step needs the token the step before is sampling for it on
        the host: penalties, a grammar, or min_tokens not yet reached. (A step's other
        samples have their whole history here.)"""
        for scheduled in scheduler_output.scheduled:
            state = self.states.get(scheduled.request_id)
            if not scheduled.sample or scheduled.token_ids[-1] != PLACEHOLDER_TOKEN or not state:
                continue
            params = state.params
            if (
                params.uses_penalties
                or params.structured_outputs is not None
                or len(state.output_token_ids) < params.min_tokens
            ):
                return True
        return False

    def record(
        self, request_ids: list[RequestId], result: SamplerOutput, failed: dict[RequestId, str]
    ) -> ModelRunnerOutput:
        """The step's tokens, appended to each request's history and fed to its grammar; a
        request whose grammar failed, or refused its token, is reported failed instead; one
        that ended while the step was in flight (its state gone) is left out."""
        token_ids = result.token_ids.tolist()
        failed = dict(failed)
        sampled: dict[RequestId, int] = {}
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            state = self.states.get(request_id)
            if request_id in failed or state is None:
                continue
            if state.matcher is not None and not state.matcher.consume_token(token_id):
                # The mask allowed only what the matcher takes: a refusal here is a broken
                # matcher, and fails this sample alone.
                failed[request_id] = f"structured outputs: the constraint refused token {token_id}"
                continue
            state.output_token_ids.append(token_id)
            sampled[request_id] = token_id
        logprobs: dict[RequestId, TokenLogprobs] = {}
        if result.logprobs is not None:
            assert result.ranks is not None
            assert result.top_ids is not None and result.top_logprobs is not None
            chosen, ranks = result.logprobs.tolist(), result.ranks.tolist()
            top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
            for row, request_id in enumerate(request_ids):
                num_top = self.states[request_id].params.logprobs
                if num_top is None or request_id not in sampled:
                    continue
                logprobs[request_id] = TokenLogprobs(
                    token_id=token_ids[row],
                    logprob=chosen[row],
                    rank=ranks[row],
                    top=tuple(zip(top_ids[row][:num_top], top_lps[row][:num_top], strict=True)),
                )
        return ModelRunnerOutput(sampled, logprobs, failed)
