"""Hit explanations: where the prefix match stopped and the one reason, for each reason, on a
real manager (block_size 4)."""

from __future__ import annotations

from blockserve.core.explain import CacheExplanation
from blockserve.core.hashing import BlockKeyInputs, MultiModalFeature, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import Request
from tests.core.helpers import HASHER, admit, assert_manager_integrity, make_manager, make_request


def run(manager: KVCacheManager, request: Request) -> None:
    """Compute and free a request: its full blocks stay cached."""
    assert admit(manager, request) is not None
    manager.free(request)


def explain(manager: KVCacheManager, request: Request) -> CacheExplanation:
    """Look up and explain, as the scheduler does before allocating."""
    _, num_hits = manager.get_computed_blocks(request)
    explanation = manager.explain(request, num_hits)
    assert explanation.first_missing_block == num_hits // 4
    assert_manager_integrity(manager)
    return explanation


def salted(request_id: str, token_ids: list[int], salt: str) -> Request:
    hasher = RequestBlockHasher(HASHER, 4)
    keys = BlockKeyInputs(cache_salt=salt)
    return Request(request_id, token_ids, block_hasher=hasher, hash_keys=keys)


def with_image(request_id: str, token_ids: list[int], identifier: str, offset: int) -> Request:
    """An image of 3 tokens at `offset`."""
    keys = BlockKeyInputs(mm_features=(MultiModalFeature(identifier, offset, 3),))
    return Request(
        request_id, token_ids, block_hasher=RequestBlockHasher(HASHER, 4), hash_keys=keys
    )


def test_the_match_stops_at_an_image() -> None:
    """Another image at 5..7, or the same one at 6..8, after the same text: the match stops at
    block 1, the first the image touches, and says so; another text there says never_stored."""
    manager = make_manager()
    tokens = list(range(13))
    run(manager, with_image("a", tokens, "cat", 5))
    for other in (with_image("b", tokens, "dog", 5), with_image("c", tokens, "cat", 6)):
        assert explain(manager, other) == CacheExplanation(1, "image")
    forked = with_image("d", [*tokens[:4], 50, *tokens[5:]], "cat", 9)
    assert explain(manager, forked) == CacheExplanation(1, "never_stored")
    assert explain(manager, with_image("e", tokens, "cat", 5)) == CacheExplanation(
        3, "partial_block"
    )


def test_never_stored() -> None:
    """A first prompt, and a prompt that leaves a cached one after block 0."""
    manager = make_manager()
    assert explain(manager, make_request("a", range(9))) == CacheExplanation(0, "never_stored")
    run(manager, make_request("a", range(9)))
    forked = make_request("b", [0, 1, 2, 3, 50, 51, 52, 53, 54])
    assert explain(manager, forked) == CacheExplanation(1, "never_stored")


def test_partial_block_and_last_token() -> None:
    """9 tokens: both full blocks hit, the 9th token is a partial block. 8 tokens: block 1
    holds the last token, which is always recomputed, so only block 0 may hit."""
    manager = make_manager()
    run(manager, make_request("nine", range(9)))
    assert explain(manager, make_request("again", range(9))) == CacheExplanation(2, "partial_block")
    assert explain(manager, make_request("eight", range(8))) == CacheExplanation(1, "last_token")
    assert explain(manager, make_request("three", range(3))) == CacheExplanation(0, "partial_block")


def test_evicted_says_how_long_ago() -> None:
    """A 4-block pool: a 16-token prompt evicts both blocks of range(9) at t=100; asked at
    t=107.25, the miss at block 0 was evicted 7.25 s ago."""
    manager = make_manager(num_blocks=5)
    run(manager, make_request("a", range(9)))
    manager.explainer.clock = lambda: 100.0
    run(manager, make_request("flood", range(500, 516)))
    manager.explainer.clock = lambda: 107.25
    assert explain(manager, make_request("b", range(9))) == CacheExplanation(0, "evicted", 7.25)


def test_a_deeper_eviction_names_its_block() -> None:
    """The deepest block goes first: evicting one block of range(13)'s three leaves blocks
    0-1, and the miss is block 2, evicted."""
    manager = make_manager(num_blocks=5)
    manager.explainer.clock = lambda: 5.0
    run(manager, make_request("a", range(13)))  # 3 hashed blocks + 1 unhashed
    run(manager, make_request("one", range(700, 705)))  # needs 2: the unhashed + block 2
    assert explain(manager, make_request("b", range(13))) == CacheExplanation(2, "evicted", 0.0)


def keyed(request_id: str, token_ids: list[int], keys: BlockKeyInputs) -> Request:
    return Request(
        request_id, token_ids, block_hasher=RequestBlockHasher(HASHER, 4), hash_keys=keys
    )


def test_other_namespace_is_said_to_unsalted_requests_of_unsalted_blocks_only() -> None:
    """Tokens cached unsalted for adapter "x" read as another namespace to an unsalted request
    without it; tokens cached under salt "a" read as never stored to salt "b", to no salt, and
    to salt "a" with another adapter: a salted namespace's content is never told."""
    manager = make_manager()
    run(manager, keyed("x", list(range(9)), BlockKeyInputs(lora_name="x")))
    assert explain(manager, make_request("plain", range(9))) == CacheExplanation(
        0, "other_namespace"
    )
    assert explain(manager, salted("b", list(range(9)), "b")) == CacheExplanation(0, "never_stored")
    run(manager, salted("a", list(range(100, 109)), "a"))
    for request in (
        salted("b", list(range(100, 109)), "b"),
        make_request("plain", range(100, 109)),
        keyed("a-y", list(range(100, 109)), BlockKeyInputs(cache_salt="a", lora_name="y")),
    ):
        assert explain(manager, request) == CacheExplanation(0, "never_stored")


def test_the_history_is_bounded_and_a_reset_is_no_eviction() -> None:
    """History of 1 hash: x's block is evicted before y's, so only y's is remembered. After
    a reset, nothing reads as evicted or as another namespace."""
    manager = make_manager(num_blocks=5)
    manager.explainer.history_size = 1
    run(manager, make_request("x", range(5)))
    run(manager, make_request("y", range(100, 105)))
    run(manager, make_request("flood", range(500, 516)))
    assert explain(manager, make_request("x2", range(5))).reason == "never_stored"
    assert explain(manager, make_request("y2", range(100, 105))).reason == "evicted"
    manager.explainer.history_size = 10
    run(manager, salted("s", list(range(300, 309)), "s"))
    assert manager.reset_prefix_cache()
    assert explain(manager, make_request("c", range(500, 516))).reason == "never_stored"
    assert explain(manager, make_request("d", range(300, 309))).reason == "never_stored"


def test_caching_off_or_skipped() -> None:
    """No prefix caching, or a request that does not read the cache: caching_disabled."""
    assert explain(make_manager(caching=False), make_request("a", range(9))) == CacheExplanation(
        0, "caching_disabled"
    )
    request = make_request("b", range(9))
    request.skip_reading_prefix_cache = True
    assert explain(make_manager(), request) == CacheExplanation(0, "caching_disabled")
