"""vLLM's `prompt_logprobs`: each prompt token's log-probability given the tokens before it
(and the top-k), from the raw logits of the prefill rows, gathered chunk by chunk and handed
over with the request's first sampled token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockserve.core.kv_cache_manager import RequestId
from blockserve.runner.request_states import RequestStates
from blockserve.sched.output import SchedulerOutput, TokenLogprobs

ROWS_PER_SLICE = 256  # rows whose [rows, vocab] float32 logits are held at once


def gather_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    scheduler_output: SchedulerOutput,
    states: RequestStates,
) -> dict[RequestId, tuple[TokenLogprobs, ...]]:
    """Add this step's prompt positions to each asking request's list; return the lists of
    the requests whose prompt ends in this step (position 0 predicts the second token)."""
    done: dict[RequestId, tuple[TokenLogprobs, ...]] = {}
    if not states.asking_prompt_logprobs:  # the common step: nothing to gather
        return done
    offset = 0
    for scheduled in scheduler_output.scheduled:
        first_row, offset = offset, offset + len(scheduled.token_ids)
        state = states.states.get(scheduled.request_id)
        if state is None or state.params.prompt_logprobs is None:
            continue
        prompt, start = state.prompt_token_ids, scheduled.num_computed_tokens
        end = start + len(scheduled.token_ids)
        positions = range(max(start, len(state.prompt_logprobs)), min(end, len(prompt) - 1))
        if positions:
            rows = hidden[first_row + positions.start - start : first_row + positions.stop - start]
            targets = prompt[positions.start + 1 : positions.stop + 1]
            state.prompt_logprobs.extend(
                _logprobs(compute_logits, rows, targets, state.params.prompt_logprobs)
            )
        if start < len(prompt) <= end:
            done[scheduled.request_id] = tuple(state.prompt_logprobs)
    return done


def _logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    num_top: int,
) -> list[TokenLogprobs]:
    out: list[TokenLogprobs] = []
    for first in range(0, len(targets), ROWS_PER_SLICE):
        rows = hidden[first : first + ROWS_PER_SLICE]
        logprobs = compute_logits(rows).float().log_softmax(dim=-1)
        wanted = torch.tensor(targets[first : first + ROWS_PER_SLICE], device=rows.device)
        chosen = logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1)
        ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
        top_lps, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [
            tuple(zip(ids, lps, strict=True))
            for ids, lps in zip(top_ids.tolist(), top_lps.tolist(), strict=True)
        ]
        out.extend(
            TokenLogprobs(token_id=t, logprob=lp, rank=r, top=top)
            for t, lp, r, top in zip(wanted.tolist(), chosen.tolist(), ranks, tops, strict=True)
        )
    return out
