"""`Request`: one generation request's token state as the scheduler and the cache see it.

Owns the prompt and output token ids, the block hashes that grow as tokens complete blocks,
and the counters the scheduler moves (`num_computed_tokens`, `num_cached_tokens`). Must not
touch tensors or text.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from blockserve.core.hashing import BlockHash, BlockHasher, BlockKeyInputs
from blockserve.errors import InvalidRequestError


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class Request:
    """The scheduler's view of one request.

    `block_hashes` always holds one hash per full block of `all_token_ids` (prompt, then
    output): appending tokens hashes exactly the blocks they complete. `num_cached_tokens` is
    the prefix-cache hit of the first admission (None before it) and never changes after.
    """

    __slots__ = (
        "_block_hasher",
        "_hash_keys",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_size",
        "cache_salt",
        "lora_name",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "skip_reading_prefix_cache",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hasher: BlockHasher | None = None,
        block_size: int = 16,
        hash_keys: BlockKeyInputs | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        keys = hash_keys or BlockKeyInputs()
        if keys.cache_salt is not None and not keys.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string")
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.block_size = block_size
        self.cache_salt = keys.cache_salt
        self.lora_name = keys.lora_name
        self.priority = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self._block_hasher = block_hasher
        self._hash_keys = keys
        self.block_hashes: list[BlockHash] = []
        self._extend_block_hashes()

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
            self._block_hasher.hash_new_blocks(
                self.all_token_ids, self.block_hashes, self.block_size, self._hash_keys
            )
        )
