"""`ModelRunner`: one `SchedulerOutput` in, one `ModelRunnerOutput` out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockserve.attention.metadata import AttentionBackend
from blockserve.core.kv_cache_manager import RequestId
from blockserve.grammar import GrammarCompiler, apply_token_masks
from blockserve.kernels import CpuKernels
from blockserve.lora.manager import LoRAManager
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.compile import CompileReport
from blockserve.model.loader import LoadedModel
from blockserve.model.sampler import Sampler, SamplingBatch, SamplingRow
from blockserve.multimodal.inputs import ImageInput
from blockserve.platform import HostCapabilities
from blockserve.runner.decode_graphs import DecodeGraphs
from blockserve.runner.images import StepImages
from blockserve.runner.inputs import ModelInputs, prepare_inputs
from blockserve.runner.launched import LaunchedStep, copy_to_host, fill_from_device
from blockserve.runner.page_mapping import KVPagePopulator
from blockserve.runner.prompt_logprobs import gather_prompt_logprobs
from blockserve.runner.request_states import RequestStates
from blockserve.sched.output import (
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)


@dataclass
class RunnerParts:
    """What runner/build.py assembles for a runner: the device and its probe, the attention
    backend, the model's shape, the KV cache (and its page mapper on a CPU), the loaded model,
    the sampler and the grammar compiler; the compiled forward and the decode graphs where
    they were made."""

    device: torch.device
    host: HostCapabilities
    backend: AttentionBackend
    arch: LlamaArchConfig
    block_size: int
    num_blocks: int
    kv_caches: list[torch.Tensor]
    kv_pages: KVPagePopulator | None
    loaded: LoadedModel
    sampler: Sampler
    grammar: GrammarCompiler
    kernels: CpuKernels  # ours on a CPU, once loaded
    lora: LoRAManager | None = None  # --enable-lora's adapters
    # The forward each step runs: the model itself (None), or its compiled graphs (--compile).
    forward: Callable[..., torch.Tensor] | None = None
    compile_report: CompileReport | None = None
    # Decode steps replayed from CUDA graphs (runner/decode_graphs.py) where captured.
    decode_graphs: DecodeGraphs | None = None


class ModelRunner:
    """Runs steps over the parts it is given (runner/build.py assembles them, runner/start.py
    readies them for the engine).

    Is handed the model, the KV cache tensors, the forward to run and the sampler;
    owns each running request's sampling state (runner/request_states.py). Builds the flat
    batch and the attention metadata, runs the forward, computes logits only where a request
    samples, and samples. Makes no scheduling decision.
    """

    def __init__(self, parts: RunnerParts) -> None:
        self.device = parts.device
        self.host = parts.host
        self.backend = parts.backend
        self.kernels = parts.kernels
        self.arch = parts.arch
        self.block_size = parts.block_size
        self.num_blocks = parts.num_blocks
        self.kv_caches = parts.kv_caches
        self.kv_pages = parts.kv_pages
        self.loaded = parts.loaded
        self.model = parts.loaded.model
        self.sampler = parts.sampler
        self.grammar = parts.grammar
        self.lora = parts.lora
        self.requests = RequestStates(parts.device, parts.grammar)
        self.forward: Callable[..., torch.Tensor] = parts.forward or self.model
        self.compile_report = parts.compile_report
        self.decode_graphs = parts.decode_graphs
        vision = parts.loaded.vision
        dtype = parts.loaded.dtype
        self.images = None if vision is None else StepImages(vision, dtype, parts.device)
        # The last step launched and not yet finished (async scheduling).
        self._unfinished: LaunchedStep | None = None

    def close(self) -> None:
        """Stop mapping KV cache pages in ahead and reading adapters (the engine is shutting
        down)."""
        if self.kv_pages is not None:
            self.kv_pages.close()
        if self.lora is not None:
            self.lora.host.close()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        return prepare_inputs(scheduler_output, self.block_size, self.device)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Requests seen for the first time must carry `new_request`."""
        return self.finish(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Run a step up to its sampled tokens, on the device and on their way to the host;
        `finish` reads them. A step launched before the one ahead of it is finished
        (async scheduling) takes that step's tokens for its placeholders on the device."""
        previous, self._unfinished = self._unfinished, None
        self.requests.update(scheduler_output)
        if self.images is not None:
            self.images.update(scheduler_output)
        if scheduler_output.is_empty:
            return LaunchedStep(output=ModelRunnerOutput())
        if previous is None:
            scheduler_output = self.requests.fill_placeholders(scheduler_output)
        inputs = self.prepare_inputs(scheduler_output)
        if previous is not None:
            fill_from_device(inputs, scheduler_output, previous)
        if self.lora is not None:
            self.lora.begin_step(scheduler_output.scheduled, self.requests.lora_of)
        if self.kv_pages is not None:
            self.kv_pages.note_written(int(inputs.metadata.slot_mapping.max()) // self.block_size)
        hidden = self._run_forward(inputs, scheduler_output)
        prompt = gather_prompt_logprobs(
            self.model.compute_logits, hidden, scheduler_output, self.requests
        )
        sampled_ids = [s.request_id for s in scheduler_output.scheduled if s.sample]
        if not sampled_ids:
            return LaunchedStep(output=ModelRunnerOutput(prompt_logprobs=prompt))
        logits = self.model.compute_logits(hidden[inputs.sample_indices])  # [sampled, vocab]
        failed = self._apply_grammars(logits, sampled_ids)
        rows = self.requests.sampling_rows(scheduler_output, self.eos_token_ids)
        try:
            result = self.sampler(
                logits, SamplingBatch.build(rows, logits.shape[-1], logits.device)
            )
        except Exception:  # one row's inputs broke the batch: find it, spare the others
            alone = self._sample_rows_alone(logits, sampled_ids, rows, failed)
            return LaunchedStep(output=dataclasses.replace(alone, prompt_logprobs=prompt))
        host, copied = copy_to_host(result)
        self._unfinished = LaunchedStep(
            sampled_ids=sampled_ids,
            token_ids=result.token_ids,
            host=host,
            failed=failed,
            copied=copied,
            prompt_logprobs=prompt,
        )
        return self._unfinished

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """A launched step's output: its tokens appended to each request's history (and fed
        to its grammar) once they are on the host."""
        if self._unfinished is step:
            self._unfinished = None
        if step.output is not None:
            return step.output
        if step.copied is not None:
            step.copied.synchronize()
        assert step.host is not None
        output = self.requests.record(step.sampled_ids, step.host, step.failed)
        if not step.prompt_logprobs:
            return output
        return dataclasses.replace(output, prompt_logprobs=step.prompt_logprobs)

    def can_launch_ahead(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step can be launched before the one ahead of it is finished: none of
        its samples needs the token history on the host (penalties, a grammar, min_tokens)."""
        return not self.requests.history_bound(scheduler_output)

    def add_images(self, request_id: RequestId, images: tuple[ImageInput, ...]) -> None:
        """A request's images (a vision-language model's), before its first step."""
        assert self.images is not None, "an image reaches a vision-language model only"
        self.images.add(request_id, images)

    def _run_forward(self, inputs: ModelInputs, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """The step's hidden states: replayed from a graph where one holds the step; the
        model itself, eager, where the step computes image positions."""
        image_embeds = None if self.images is None else self.images.for_step(scheduler_output)
        if self.decode_graphs is not None and image_embeds is None:
            hidden = self.decode_graphs.run(inputs)
            if hidden is not None:
                return hidden
        plan = self.backend.prepare(inputs.metadata)
        if image_embeds is not None:
            return self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, plan, image_embeds
            )
        return self.forward(inputs.input_ids, inputs.positions, self.kv_caches, plan)

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
                output = self.requests.record([request_id], self.sampler(row_logits, batch), {})
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                continue
            sampled.update(output.sampled_token_ids)
            logprobs.update(output.logprobs)
            failed.update(output.failed)
        return ModelRunnerOutput(sampled, logprobs, failed)
