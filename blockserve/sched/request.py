"""`Request`: one generation request's token state as the scheduler and the cache see it. Owns the
prompt and output token ids, the block hashes that grow as tokens complete blocks, the counters
the scheduler moves (`num_computed_tokens`, `num_cached_tokens`) and the stop conditions that
need no text. Must not touch tensors or text (stop strings live in engine/)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from blockserve.core.explain import CacheExplanation
from blockserve.core.hashing import BlockHash, BlockKeyInputs, RequestBlockHasher
from blockserve.core.kv_cache_manager import RequestId
from blockserve.sampling_params import SamplingParams
from blockserve.sched.encoder_cache import EncoderInput


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    LOADING = enum.auto()  # admitted; its next blocks are being loaded from a lower KV tier
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason: stop, length, abort or error (None while running)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """The scheduler's view of one request (one sample of it when `n > 1`).

    `block_hashes` always holds one hash per full block of `all_token_ids` (prompt, then
    output): appending tokens hashes exactly the blocks they complete. `num_cached_tokens` is
    the prefix-cache hit of the first admission (None before it) and never changes after.
    `priority` (lower first) and `arrival_time` order the waiting queue under `priority`.
    A caller sets `explain_cache` before adding the request to have `cache_explanation` (why
    the prefix match stopped) filled at its first admission.
    """

    __slots__ = (
        "_block_hasher",
        "_hash_keys",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_explanation",
        "cache_salt",
        "explain_cache",
        "group_id",
        "images",
        "lora_name",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "sampling_params",
        "skip_reading_prefix_cache",
        "status",
        "stop_reason",
        "tier_cached_tokens",
        "tier_identity",
    )

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        block_hasher: RequestBlockHasher | None = None,
        hash_keys: BlockKeyInputs | None = None,
        priority: int = 0,
    ) -> None:
        assert prompt_token_ids, "an empty prompt is refused before it reaches the scheduler"
        keys = hash_keys or BlockKeyInputs()
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.cache_salt = keys.cache_salt
        self.lora_name = keys.lora_name
        self.priority = priority
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Under async scheduling: tokens being sampled by steps in flight, not yet appended.
        self.num_output_placeholders = 0
        self.num_cached_tokens: int | None = None
        # The part of num_cached_tokens loaded from each lower tier, by its name.
        self.tier_cached_tokens: dict[str, int] = {}
        # Its adapter's content digest: its blocks' keys in the tiers (core.hashing.tier_key).
        self.tier_identity: bytes | None = None
        self.explain_cache = False
        # The scheduler's fairness unit: the caller's whole request (its n samples, its
        # prompts); by default the request itself.
        self.group_id = str(request_id)
        self.cache_explanation: CacheExplanation | None = None
        # A vision-language model's images of the prompt (multimodal/inputs.py's ImageInput),
        # in prompt order: the encoder cache's items (sched/encoder_cache.py).
        self.images: tuple[EncoderInput, ...] = ()
        self.num_preemptions = 0
        # Prompt logprobs need every position's logits, so such a request never reads the cache.
        self.skip_reading_prefix_cache = self.sampling_params.prompt_logprobs is not None
        self._block_hasher = block_hasher
        self._hash_keys = keys
        self.block_hashes: list[BlockHash] = []
        self._extend_block_hashes()

    @property
    def hash_keys(self) -> BlockKeyInputs:
        """What besides its tokens enters this request's block hashes."""
        return self._hash_keys

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks_hashed={len(self.block_hashes)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_tokens_ahead(self) -> int:
        """num_tokens with the tokens in flight: what the next step may compute up to."""
        return len(self.all_token_ids) + self.num_output_placeholders

    def chunk_limit(self, budget: int, max_scored_tokens: int) -> int:
        """The most tokens the next step may compute for it within `budget`: at most
        `max_scored_tokens` while its prompt is being scored (prompt logprobs: each position
        costs a row of logits over the whole vocabulary)."""
        scoring = self.sampling_params.prompt_logprobs is not None
        if scoring and self.num_computed_tokens < self.num_prompt_tokens:
            return min(budget, max_scored_tokens)
        return budget

    def stops_in_flight(self, max_model_len: int) -> bool:
        """Whether a token in flight is certain to end the request (max_tokens, the context):
        nothing is scheduled after it."""
        if not self.num_output_placeholders:
            return False
        max_tokens = self.sampling_params.max_tokens
        num_output = self.num_output_tokens + self.num_output_placeholders
        return (max_tokens is not None and num_output >= max_tokens) or (
            self.num_tokens_ahead >= max_model_len
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash every block they complete."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        if self._block_hasher is None:
            return
        self.block_hashes.extend(
            self._block_hasher(self.all_token_ids, self.block_hashes, self._hash_keys)
        )
