"""Request: token bookkeeping and block hashes that grow exactly with completed blocks."""

from __future__ import annotations

from blockserve.core.hashing import BlockHasher, BlockKeyInputs, RequestBlockHasher
from blockserve.sched.request import Request, RequestStatus

HASHER = RequestBlockHasher(BlockHasher("sha256"), 4)


def test_block_hashes_follow_full_blocks_only() -> None:
    """10 prompt tokens in blocks of 4 hash 2 blocks; 2 more tokens complete the third."""
    request = Request("r", list(range(10)), block_hasher=HASHER)
    assert len(request.block_hashes) == 2
    request.append_output_token_ids(10)
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([11, 12])
    assert len(request.block_hashes) == 3
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (10, 3, 13)
    assert request.output_token_ids == [10, 11, 12]


def test_output_tokens_hash_like_the_same_tokens_in_a_prompt() -> None:
    """A follow-up prompt equal to prompt + output gets the same hashes (behaviour item 5)."""
    first = Request("a", list(range(6)), block_hasher=HASHER)
    first.append_output_token_ids([6, 7])
    follow_up = Request("b", list(range(8)), block_hasher=HASHER)
    assert first.block_hashes == follow_up.block_hashes


def test_a_salt_changes_every_hash() -> None:
    """The salt keys block 0, and through the chain every block after it."""
    plain = Request("a", list(range(8)), block_hasher=HASHER)
    salted = Request(
        "b", list(range(8)), block_hasher=HASHER, hash_keys=BlockKeyInputs(cache_salt="t")
    )
    assert all(p != s for p, s in zip(plain.block_hashes, salted.block_hashes, strict=True))


def test_statuses_after_preempted_are_final_with_openai_reasons() -> None:
    """Finished statuses map to stop, length, abort and error; the others to None."""
    reasons = {status.name: status.finish_reason for status in RequestStatus}
    assert reasons == {
        "WAITING": None,
        "RUNNING": None,
        "LOADING": None,
        "PREEMPTED": None,
        "FINISHED_STOPPED": "stop",
        "FINISHED_LENGTH_CAPPED": "length",
        "FINISHED_ABORTED": "abort",
        "FINISHED_ERROR": "error",
    }
    assert [s.is_finished for s in RequestStatus] == [False] * 4 + [True] * 4
