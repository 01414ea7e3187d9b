"""When a sample stops on the token it just drew: EOS, a stop token, max_tokens, or the
context's end. The scheduler's rule, kept apart from its batching (stop strings are the
output processor's: they need the text)."""

from __future__ import annotations

from collections.abc import Container

from blockserve.sched.request import Request, RequestStatus


def check_stop(
    request: Request, token_id: int, eos_token_ids: Container[int], max_model_len: int
) -> RequestStatus | None:
    """The finished status `token_id` (already appended) gives `request`, or None to go on.
    EOS and stop tokens count only from `min_tokens` on; a stop token is kept as the
    request's `stop_reason`."""
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
