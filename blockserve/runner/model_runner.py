"""`ModelRunner`: one `SchedulerOutput` in, one `ModelRunnerOutput` out.

Owns the model, the KV cache tensors and each running request's sampling state (its token
history for penalties, its seeded generator). Builds the flat batch and the attention
metadata, runs the forward, computes logits only at positions that sample, and samples.
Makes no scheduling decision.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance
import torch

from blockserve.attention import cpu_kernels
from blockserve.attention.selector import get_attention_backend
from blockserve.config import CacheConfig, ModelConfig, default_cache_dir
from blockserve.core.kv_cache_manager import RequestId
from blockserve.grammar import GrammarCompiler, apply_token_masks
from blockserve.model.compile import CompileReport, compile_forward, mark_token_dim_dynamic
from blockserve.model.loader import (
    LoadedModel,
    load_model,
    read_arch,
    resolve_dtype,
    resolve_model_dir,
)
from blockserve.model.packed import pack_once_loaded
from blockserve.model.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRow
from blockserve.platform import probe_host, warn_if_slow
from blockserve.runner.first_touch import KVPagePopulator, keep_freed_memory
from blockserve.runner.inputs import ModelInputs, prepare_inputs
from blockserve.runner.kv_cache import (
    allocate_kv_caches,
    num_blocks_for,
)
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import (
    ModelRunnerOutput,
    ScheduledRequest,
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


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, kv_blocks_per_step: int = 0
    ) -> None:
        """`kv_blocks_per_step`: the most never-used blocks a step can take; on a CPU their
        pages are mapped in ahead of the steps (first_touch.py). 0: left to first writes."""
        device = model_config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.backend = get_attention_backend(model_config.attention_backend, device)
        self.host = probe_host(self.device)
        dtype = resolve_dtype(model_config.dtype, self.host)
        warn_if_slow(dtype, self.host)
        model_dir = resolve_model_dir(model_config.model)
        self.arch = read_arch(model_dir)
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks_for(
            self.arch,
            self.block_size,
            dtype,
            cache_config.num_gpu_blocks_override,
            cache_config.kv_cache_memory_bytes,
        )
        self.kv_caches = allocate_kv_caches(
            self.arch, self.num_blocks, self.block_size, dtype, self.device
        )
        self.kv_pages: KVPagePopulator | None = None
        if self.device.type == "cpu" and kv_blocks_per_step > 0:  # maps while weights load
            self.kv_pages = KVPagePopulator(self.kv_caches, ahead=2 * kv_blocks_per_step)
        self.loaded: LoadedModel = load_model(
            model_config.model, self.backend, dtype, device, model_dir=model_dir
        )
        self.model = self.loaded.model
        if self.kv_pages is not None:
            keep_freed_memory()  # for the steps' temporaries; the loading's are gone
            self.kv_pages.map_now(kv_blocks_per_step)  # the first step writes mapped memory
        if cpu_kernels.serves(self.device, dtype, self.arch.head_dim):
            cpu_kernels.start_loading(default_cache_dir(), dtype)  # torch's kernel serves meanwhile
            if cpu_kernels.supported(dtype):
                cpu_kernels.when_loaded(dtype, pack_once_loaded(weakref.ref(self.model), dtype))
        # Unseeded requests draw from one generator seeded by --seed: a run is reproducible.
        generator = torch.Generator(device=self.device)
        generator.manual_seed(model_config.seed)
        self.sampler = Sampler(generator)
        self.grammar = GrammarCompiler(
            self.loaded.tokenizer,
            self.arch.vocab_size,
            self.arch.eos_token_ids,
            model_config.structured_outputs_max_whitespace,
            model_config.structured_outputs_limits,
        )
        self.requests: dict[RequestId, RequestState] = {}
        # The forward each step runs: the model itself, or its compiled graphs (--compile).
        self.forward: Callable[..., torch.Tensor] = self.model
        self.compile_report: CompileReport | None = None
        if model_config.compile:
            self.forward, self.compile_report = compile_forward(
                self.model, self.backend, default_cache_dir(), self._warm_up
            )

    def _warm_up(self, forward: Callable[..., torch.Tensor]) -> None:
        """Run `forward` on a dummy prefill of 16 tokens (its token dimension traced as
        dynamic) and a dummy one-token decode after it (the same graph must serve it), in the
        first blocks after the null block: they hold nothing yet (a request's blocks are
        written before they are read)."""
        prompt = (0,) * 16
        blocks = tuple(range(1, 1 + -(-(len(prompt) + 1) // self.block_size)))
        steps = (
            ScheduledRequest("warm-up", prompt, 0, blocks, sample=False),
            ScheduledRequest("warm-up", (0,), len(prompt), blocks, sample=False),
        )
        for step in steps:
            inputs = self.prepare_inputs(SchedulerOutput((step,)))
            mark_token_dim_dynamic(inputs.input_ids, inputs.positions)
            plan = self.backend.prepare(inputs.metadata)
            forward(inputs.input_ids, inputs.positions, self.kv_caches, plan)

    def close(self) -> None:
        """Stop mapping KV cache pages in ahead (the engine is shutting down)."""
        if self.kv_pages is not None:
            self.kv_pages.close()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for scheduled in scheduler_output.scheduled:
            new = scheduled.new_request
            if new is None:
                continue
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            state = RequestState(
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                generator,
            )
            constraint = new.sampling_params.structured_outputs
            if constraint is not None:
                try:
                    state.matcher = self.grammar.matcher(constraint, state.output_token_ids)
                except Exception as exc:  # fails this sample when it samples, no other
                    state.grammar_error = f"{type(exc).__name__}: {exc}"
            self.requests[scheduled.request_id] = state

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        return prepare_inputs(scheduler_output, self.block_size, self.device)

    def _sampling_rows(self, scheduler_output: SchedulerOutput) -> list[SamplingRow]:
        rows = []
        for scheduled in scheduler_output.scheduled:
            if not scheduled.sample:
                continue
            state = self.requests[scheduled.request_id]
            banned: tuple[int, ...] = ()
            if len(state.output_token_ids) < state.params.min_tokens:
                # Stopping is not allowed yet, so neither are the tokens that would stop.
                banned = (*self.eos_token_ids, *state.params.stop_token_ids)
            rows.append(
                SamplingRow(
                    state.params,
                    state.prompt_token_ids,
                    state.output_token_ids,
                    state.generator,
                    banned,
                )
            )
        return rows

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Requests seen for the first time must carry `new_request`."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(scheduler_output)
        if self.kv_pages is not None:
            self.kv_pages.note_written(int(inputs.metadata.slot_mapping.max()) // self.block_size)
        plan = self.backend.prepare(inputs.metadata)
        hidden = self.forward(inputs.input_ids, inputs.positions, self.kv_caches, plan)
        sampled_ids = [s.request_id for s in scheduler_output.scheduled if s.sample]
        if not sampled_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_indices])  # [sampled, vocab]
        failed = self._apply_grammars(logits, sampled_ids)
        rows = self._sampling_rows(scheduler_output)
        try:
            result = self.sampler(
                logits, SamplingBatch.build(rows, logits.shape[-1], logits.device)
            )
        except Exception:  # one row's inputs broke the batch: find it, spare the others
            return self._sample_rows_alone(logits, sampled_ids, rows, failed)
        return self._to_output(sampled_ids, result, failed)

    def _apply_grammars(
        self, logits: torch.Tensor, request_ids: list[RequestId]
    ) -> dict[RequestId, str]:
        """Mask the constrained rows' logits; {request: error} for those whose grammar failed."""
        states = [self.requests[request_id] for request_id in request_ids]
        failed = {
            request_id: f"structured outputs failed: {state.grammar_error}"
            for request_id, state in zip(request_ids, states, strict=True)
            if state.grammar_error is not None
        }
        row_errors = apply_token_masks(logits, [state.matcher for state in states])
        failed.update({request_ids[row]: error for row, error in row_errors.items()})
        return failed

    def _sample_rows_alone(
        self,
        logits: torch.Tensor,
        request_ids: list[RequestId],
        rows: list[SamplingRow],
        failed: dict[RequestId, str],
    ) -> ModelRunnerOutput:
        """Sample each row in a batch of its own; a row that raises fails its request alone,
        with its own error. (Rows drawing from the shared generator may draw other noise than
        in the failed batch; seeded rows have generators of their own.)"""
        sampled: dict[RequestId, int] = {}
        logprobs: dict[RequestId, TokenLogprobs] = {}
        failed = dict(failed)
        for index, (request_id, row) in enumerate(zip(request_ids, rows, strict=True)):
            if request_id in failed:
                continue
            row_logits = logits[index : index + 1]
            try:
                batch = SamplingBatch.build([row], row_logits.shape[-1], row_logits.device)
                output = self._to_output([request_id], self.sampler(row_logits, batch), {})
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                continue
            sampled.update(output.sampled_token_ids)
            logprobs.update(output.logprobs)
            failed.update(output.failed)
        return ModelRunnerOutput(sampled, logprobs, failed)

    def _to_output(
        self, request_ids: list[RequestId], result: SamplerOutput, failed: dict[RequestId, str]
    ) -> ModelRunnerOutput:
        """The step's tokens, appended to each request's history and fed to its grammar; a
        request whose grammar failed, or refused its token, is reported failed instead."""
        token_ids = result.token_ids.tolist()
        failed = dict(failed)
        sampled: dict[RequestId, int] = {}
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            if request_id in failed:
                continue
            state = self.requests[request_id]
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
                num_top = self.requests[request_id].params.logprobs
                if num_top is None or request_id not in sampled:
                    continue
                logprobs[request_id] = TokenLogprobs(
                    token_ids[row],
                    chosen[row],
                    ranks[row],
                    tuple(zip(top_ids[row][:num_top], top_lps[row][:num_top], strict=True)),
                )
        return ModelRunnerOutput(sampled, logprobs, failed)
