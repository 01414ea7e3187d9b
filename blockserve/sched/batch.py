"""What the runner is told each step: for each running request the scheduler gave tokens to,
the tokens to compute, where its blocks are, whether to sample, and (the first time the runner
sees it) its prompt and sampling parameters. Advances each request's computed tokens."""

from __future__ import annotations

from collections.abc import Collection

from blockserve.core.kv_cache_manager import KVCacheManager, RequestId
from blockserve.sched.output import PLACEHOLDER_TOKEN, NewRequestData, ScheduledRequest
from blockserve.sched.request import Request


def batch_for_runner(
    running: list[Request],
    num_scheduled: dict[RequestId, int],
    first_sent: Collection[RequestId],
    kv_cache_manager: KVCacheManager,
    ahead: bool = False,
) -> tuple[ScheduledRequest, ...]:
    """The step's requests in running order; `first_sent`: those the runner has not seen (new,
    or back from a tier load), sent with their prompt and sampling parameters. `ahead` (async
    scheduling): a token this step samples counts as in flight until its output is applied,
    and a later step sends it as PLACEHOLDER_TOKEN."""
    scheduled = []
    for request in running:
        num_new = num_scheduled.get(request.request_id)
        if num_new is None:
            continue
        start = request.num_computed_tokens
        end = start + num_new
        new_data = None
        if request.request_id in first_sent:
            new_data = NewRequestData(
                prompt_token_ids=tuple(request.prompt_token_ids),
                output_token_ids=tuple(request.output_token_ids),
                sampling_params=request.sampling_params,
                lora_name=request.lora_name,
            )
        token_ids = request.all_token_ids[start:end]
        if len(token_ids) < num_new:  # tokens still in flight
            token_ids = [*token_ids, *(PLACEHOLDER_TOKEN,) * (num_new - len(token_ids))]
        sample = end == request.num_tokens_ahead
        scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=tuple(token_ids),
                num_computed_tokens=start,
                block_ids=tuple(kv_cache_manager.get_block_ids(request.request_id)),
                sample=sample,
                new_request=new_data,
            )
        )
        if sample and ahead:
            request.num_output_placeholders += 1
        # Optimistic: the runner computes these tokens before the next schedule().
        request.num_computed_tokens = end
    return tuple(scheduled)
