"""The stop rule of a sample on the token it just drew (sched/stops.py)."""

from __future__ import annotations

from blockserve.sampling_params import SamplingParams
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.stops import check_stop

EOS = 2


def drew(token_id: int, num_output: int = 1, **params: object) -> tuple[Request, int]:
    """A 4-token prompt that has drawn `num_output` tokens, the last `token_id`."""
    request = Request("r", [10, 11, 12, 13], SamplingParams(**params))  # type: ignore[arg-type]
    for _ in range(num_output - 1):
        request.append_output_token_ids(7)
    request.append_output_token_ids(token_id)
    return request, token_id


def test_eos_stops_unless_ignored_or_too_early() -> None:
    """EOS stops; not with ignore_eos, nor before min_tokens."""
    assert check_stop(*drew(EOS), {EOS}, 100) == RequestStatus.FINISHED_STOPPED
    assert check_stop(*drew(EOS, ignore_eos=True), {EOS}, 100) is None
    assert check_stop(*drew(EOS, min_tokens=2), {EOS}, 100) is None


def test_a_stop_token_stops_and_is_the_reason() -> None:
    """A stop token id ends the sample and is kept as its stop_reason."""
    request, token = drew(9, stop_token_ids=(9,))
    assert check_stop(request, token, {EOS}, 100) == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9


def test_max_tokens_and_the_context_cap_the_length() -> None:
    """The max_tokens-th token ends it; so does the context's last position."""
    assert check_stop(*drew(7, 3, max_tokens=3), {EOS}, 100) == RequestStatus.FINISHED_LENGTH_CAPPED
    assert check_stop(*drew(7, 2, max_tokens=3), {EOS}, 100) is None
    assert check_stop(*drew(7, 2), {EOS}, 6) == RequestStatus.FINISHED_LENGTH_CAPPED
