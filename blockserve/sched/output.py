"""The two interface objects of a step: `SchedulerOutput` (sched → runner) and `ModelRunnerOutput`
(runner → sched). Frozen dataclasses of plain Python values, no tensors: the scheduler stays
torch-free, and a step can be logged, compared in tests, or sent to another process as it is."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockserve.core.kv_cache_manager import RequestId
from blockserve.sampling_params import SamplingParams
from blockserve.sched.request import RequestStatus

# A token the scheduler sends before it is known (async scheduling): the one a step in flight is
# sampling for the request; the runner puts it in place before the step runs.
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner must know of a request the first time it is scheduled (or resumed)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

        positions: |<- num_computed_tokens (in the KV cache) ->|<- token_ids (this step) ->|

    `block_ids` is the request's whole block table after this step's allocation. `sample` is
    True when the step reaches the request's last known token, so a new token is sampled.
    """

    request_id: RequestId
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    sample: bool
    new_request: NewRequestData | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step, in batch order."""

    scheduled: tuple[ScheduledRequest, ...]
    finished_request_ids: frozenset[RequestId] = frozenset()
    # A vision-language model's: the images to encode this step, (request, index among its
    # images), and the images whose encoder outputs the runner may drop (their identifiers).
    encoder_inputs: tuple[tuple[RequestId, int], ...] = ()
    freed_encoder_ids: tuple[str, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, by request id (only requests whose `sample` was True),
    and the requests whose own sampling failed, with the error (their neighbours unharmed)."""

    sampled_token_ids: dict[RequestId, int] = field(default_factory=dict)
    logprobs: dict[RequestId, TokenLogprobs] = field(default_factory=dict)
    failed: dict[RequestId, str] = field(default_factory=dict)
    # prompt_logprobs of the requests whose prompt ended in the step (positions 1..)
    prompt_logprobs: dict[RequestId, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step did to one request: its new token (if any) and whether it finished."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    status: RequestStatus
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    stop_reason: int | str | None = None  # the stop token id, when one ended it
