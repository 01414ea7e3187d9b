"""A step launched on the device and not read back yet (async scheduling): its sampled tokens
stay on the device for the next step's placeholders, and are copied to the host behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockserve.core.kv_cache_manager import RequestId
from blockserve.model.sampler import SamplerOutput
from blockserve.runner.inputs import ModelInputs
from blockserve.sched.output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)


@dataclass
class LaunchedStep:
    """What `ModelRunner.launch` leaves for `finish`: a step already complete (`output`: it
    sampled nothing, or row by row), or its sampled requests, their tokens on the device, the
    sampler's output on its way to the host and the event that marks it there."""

    output: ModelRunnerOutput | None = None
    sampled_ids: list[RequestId] = field(default_factory=list)
    token_ids: torch.Tensor | None = None  # [sampled] on the device
    host: SamplerOutput | None = None
    failed: dict[RequestId, str] = field(default_factory=dict)
    copied: torch.cuda.Event | None = None
    prompt_logprobs: dict[RequestId, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


def copy_to_host(result: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """The sampler's output copied to (pinned) host memory behind the step's kernels, and on
    CUDA the event recorded after the copies: a later step's kernels need not finish first."""
    if result.token_ids.device.type != "cuda":
        return result, None

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to("cpu", non_blocking=True)

    copied = SamplerOutput(
        token_ids=result.token_ids.to("cpu", non_blocking=True),
        logprobs=host(result.logprobs),
        ranks=host(result.ranks),
        top_ids=host(result.top_ids),
        top_logprobs=host(result.top_logprobs),
    )
    event = torch.cuda.Event()
    event.record()
    return copied, event


def fill_from_device(
    inputs: ModelInputs, scheduler_output: SchedulerOutput, previous: LaunchedStep
) -> None:
    """Put the tokens `previous` sampled, still on the device, where this step's inputs hold
    PLACEHOLDER_TOKEN (one per request: the step before sampled it)."""
    rows = {request_id: row for row, request_id in enumerate(previous.sampled_ids)}
    positions, sources = [], []
    start = 0
    for scheduled in scheduler_output.scheduled:
        start += len(scheduled.token_ids)
        if scheduled.token_ids[-1] != PLACEHOLDER_TOKEN:
            continue
        if scheduled.token_ids.count(PLACEHOLDER_TOKEN) != 1 or scheduled.request_id not in rows:
            raise RuntimeError(f"{scheduled.request_id}: a placeholder no step in flight fills")
        positions.append(start - 1)
        sources.append(rows[scheduled.request_id])
    if positions:
        assert previous.token_ids is not None
        device = inputs.input_ids.device
        index = torch.tensor(positions, device=device)
        tokens = previous.token_ids[torch.tensor(sources, device=device)]
        inputs.input_ids.index_copy_(0, index, tokens)
