"""Steps over no request, run before the runner exists: the warm-up that traces or compiles a
forward, and the memory profile that sizes the KV cache on CUDA. Both write only blocks no
request holds yet (a request's blocks are written before they are read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from blockserve.model.compile import mark_token_dim_dynamic
from blockserve.runner.inputs import prepare_inputs
from blockserve.sched.output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from blockserve.runner.model_runner import RunnerParts


def warm_up(parts: RunnerParts, forward: Callable[..., torch.Tensor]) -> None:
    """Run `forward` on a dummy prefill of 16 tokens (its token dimension traced as dynamic)
    and a dummy one-token decode after it (the same graph must serve it), in the first blocks
    after the null block."""
    prompt = (0,) * 16
    blocks = tuple(range(1, 1 + -(-(len(prompt) + 1) // parts.block_size)))
    steps = (
        ScheduledRequest(
            request_id="warm-up",
            token_ids=prompt,
            num_computed_tokens=0,
            block_ids=blocks,
            sample=False,
        ),
        ScheduledRequest(
            request_id="warm-up",
            token_ids=(0,),
            num_computed_tokens=len(prompt),
            block_ids=blocks,
            sample=False,
        ),
    )
    for step in steps:
        inputs = prepare_inputs(SchedulerOutput((step,)), parts.block_size, parts.device)
        mark_token_dim_dynamic(inputs.input_ids, inputs.positions)
        plan = parts.backend.prepare(inputs.metadata)
        forward(inputs.input_ids, inputs.positions, parts.kv_caches, plan)


@torch.inference_mode()
def profile_run(parts: RunnerParts, lengths: list[int]) -> None:
    """One step of prefills of `lengths` tokens from position 0, each in blocks of its own
    after the null block, logits and probabilities for each: the memory a step can take."""
    steps, first = [], 1
    for index, length in enumerate(lengths):
        count = -(-length // parts.block_size)
        blocks = tuple(range(first, first + count))
        steps.append(
            ScheduledRequest(
                request_id=f"profile-{index}",
                token_ids=(0,) * length,
                num_computed_tokens=0,
                block_ids=blocks,
                sample=True,
            )
        )
        first += count
    inputs = prepare_inputs(SchedulerOutput(tuple(steps)), parts.block_size, parts.device)
    plan = parts.backend.prepare(inputs.metadata)
    model = parts.loaded.model
    hidden = model(inputs.input_ids, inputs.positions, parts.kv_caches, plan)
    torch.softmax(model.compute_logits(hidden[inputs.sample_indices]).float(), dim=-1)
