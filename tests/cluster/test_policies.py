"""Routing policies on hand-built indices: the exact replica each request goes to."""

from __future__ import annotations

import itertools

import pytest

from blockserve.cluster.baselines import (
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    TextPrefixPolicy,
    TextTree,
)
from blockserve.cluster.policies import KVAwarePolicy, make_policy
from blockserve.cluster.routing import ReplicaLoad, RouteRequest, route_request
from blockserve.core.events import BlockStored, KVEventBatch
from blockserve.core.hashing import (
    BlockHasher,
    BlockKeyInputs,
    MultiModalFeature,
    RequestBlockHasher,
)
from blockserve.engine.request import RequestSpec
from blockserve.errors import InvalidConfigError
from blockserve.multimodal.inputs import ImageInput
from blockserve.sched.request import Request

HASHES = (11, 12, 13, 14)


def stored(*hashes: int) -> KVEventBatch:
    event = BlockStored(list(hashes), None, [], 4, None, "GPU", None)
    return KVEventBatch(ts=0.0, events=[event])


def kv_policy(weight: float = 1.0, holdings: dict[str, tuple[int, ...]] | None = None):
    policy = KVAwarePolicy(max_blocks_per_replica=16, prefix_weight=weight, credit_ttl_s=10.0)
    for replica_id, hashes in (holdings or {}).items():
        policy.index(replica_id).apply([stored(*hashes)])
    return policy


def loads(**num_requests: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id, n) for replica_id, n in num_requests.items()]


_FRESH = itertools.count(1000)  # block hashes no test holds


def queue(policy: KVAwarePolicy, replica_id: str, blocks: int, request_id: str) -> None:
    """Route to `replica_id` a request of `blocks` blocks that nobody holds."""
    hashes = tuple(next(_FRESH) for _ in range(blocks))
    policy.on_routed(RouteRequest(hashes), replica_id, 0.0, request_id)


@pytest.mark.parametrize(
    ("weight", "queued", "expected"),
    [(1.0, 3, "a"), (1.0, 4, "b"), (1.0, 5, "b"), (2.0, 7, "a"), (2.0, 8, "b"), (0.0, 1, "b")],
)
def test_overlap_beats_queued_work_until_the_gap_reaches_the_weighted_overlap(
    weight: float, queued: int, expected: str
) -> None:
    """a holds the request's 4 blocks: worth 4 x weight blocks of queued work. Below that
    queue a wins; at it the scores tie and b, with fewer requests in flight, wins; above it b
    wins outright. Weight 0: load alone."""
    policy = kv_policy(weight, {"a": HASHES})
    queue(policy, "a", queued, "earlier")
    scores = policy.scores(RouteRequest(HASHES), loads(a=1, b=0), now=0.0)
    assert [(s.overlap, s.queued, s.value) for s in scores] == [
        (4, queued, weight * 4 - queued),
        (0, 0, 0.0),
    ]
    assert policy.rank(RouteRequest(HASHES), loads(a=1, b=0), now=0.0)[0] == expected


def test_a_request_queues_what_it_missed_until_it_finishes() -> None:
    """A request routed to a replica adds the blocks that replica lacked (at least 1: a full
    hit still decodes) to its queue; its end, or a forgotten replica, takes them off."""
    policy = kv_policy(1.0, {"a": HASHES[:3]})
    policy.on_routed(RouteRequest(HASHES), "a", 0.0, "r1")  # misses 1 of 4
    policy.on_routed(RouteRequest(HASHES), "a", 0.0, "r2")  # all 4 credited now: counts 1
    policy.on_routed(RouteRequest(HASHES), "b", 0.0, "r3")  # misses all 4
    assert policy.queued == {"a": 2, "b": 4}
    policy.on_finished("r1")
    policy.on_finished("r1")  # reported twice: taken off once
    policy.on_finished("unknown")
    assert policy.queued == {"a": 1, "b": 4}
    policy.on_routed(RouteRequest(HASHES), "a", 0.0, "r3")  # the same id again: moves
    assert policy.queued == {"a": 2, "b": 0}
    policy.forget("a")
    policy.on_finished("r2")
    assert policy.queued == {"b": 0}


def test_requests_whose_end_never_comes_are_dropped_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the router tracks is bounded: past the bound, the oldest request's blocks leave
    its replica's queue as if it had ended."""
    monkeypatch.setattr("blockserve.cluster.policies._MAX_TRACKED", 2)
    policy = kv_policy(1.0)
    queue(policy, "a", 3, "r1")
    queue(policy, "b", 2, "r2")
    assert policy.queued == {"a": 3, "b": 2}
    queue(policy, "b", 1, "r3")
    assert policy.queued == {"a": 0, "b": 3}
    policy.on_finished("r1")  # already dropped: nothing taken off twice
    assert policy.queued == {"a": 0, "b": 3}


def test_scores_count_leading_blocks_only() -> None:
    """Overlap stops at the first block a replica lacks: holding blocks 1, 3, 4 is 1 block."""
    policy = kv_policy(4.0, {"a": (11, 13, 14), "b": (11, 12)})
    scores = policy.scores(RouteRequest(HASHES), loads(a=0, b=0), now=0.0)
    assert [(s.replica_id, s.overlap, s.value) for s in scores] == [("a", 1, 4.0), ("b", 2, 8.0)]


def test_zero_overlap_goes_to_the_shortest_queue_then_the_least_loaded_then_the_emptier_cache() -> (
    None
):
    """No replica holds the prompt: the shortest queue wins; at equal queues, fewer requests
    in flight; at equal load, fewer cached blocks."""
    policy = kv_policy(1.0, {"a": (1, 2, 3), "b": (4,), "c": ()})
    assert policy.rank(RouteRequest(HASHES), loads(a=0, b=1, c=2), 0.0) == ["a", "b", "c"]
    assert policy.rank(RouteRequest(HASHES), loads(a=1, b=1, c=1), 0.0) == ["c", "b", "a"]
    queue(policy, "c", 2, "r1")
    queue(policy, "b", 1, "r2")
    assert policy.rank(RouteRequest(HASHES), loads(a=1, b=1, c=1), 0.0) == ["a", "b", "c"]


def test_a_request_shorter_than_a_block_goes_to_the_shortest_queue() -> None:
    """No full block, no overlap: load alone decides."""
    policy = kv_policy(1.0, {"a": HASHES})
    queue(policy, "a", 2, "r1")
    queue(policy, "b", 1, "r2")
    assert policy.rank(RouteRequest(()), loads(a=1, b=1), 0.0)[0] == "b"


def test_credit_keeps_a_burst_together_until_it_expires() -> None:
    """A routed request credits its blocks at once: the next of its prefix follows it even
    before any event (with the default weight, a held block outweighs the block it queues);
    after the TTL the credit is gone."""
    policy = KVAwarePolicy(max_blocks_per_replica=16, credit_ttl_s=10.0)
    request = RouteRequest(HASHES)
    first = policy.rank(request, loads(a=0, b=0), now=0.0)[0]
    policy.on_routed(request, first, 0.0, "r1")
    assert policy.rank(request, loads(a=1, b=0), now=1.0)[0] == first == "a"
    assert policy.index("a").num_credits == 4
    assert policy.rank(request, loads(a=1, b=0), now=10.5)[0] == "b"
    assert policy.index("a").num_credits == 0


def test_credits_are_bounded_by_the_replica_capacity() -> None:
    """Oldest credits go first once a replica's credits exceed its block count."""
    policy = KVAwarePolicy(max_blocks_per_replica=3, credit_ttl_s=10.0)
    policy.on_routed(RouteRequest(HASHES), "a", 0.0, "r1")
    assert policy.index("a").num_credits == 3
    assert policy.index("a").overlap(HASHES, now=0.0) == 0  # block 11, the first, was dropped
    assert policy.index("a").overlap(HASHES[1:], now=0.0) == 3


def test_salted_and_unsalted_prompts_never_share_credit() -> None:
    """The router hashes as the engines do: a cache salt changes every block hash, so a
    salted prompt gets no overlap from the unsalted one's replica, nor two salts from
    each other."""
    hasher = BlockHasher("sha256")
    tokens = tuple(range(16))
    plain = route_request(RequestSpec("r1", tokens), hasher, 4)
    salted = route_request(RequestSpec("r2", tokens, cache_salt="tenant-1"), hasher, 4)
    other = route_request(RequestSpec("r3", tokens, cache_salt="tenant-2"), hasher, 4)
    policy = kv_policy(2.0)
    policy.on_routed(plain, "a", 0.0, "r1")
    policy.on_routed(salted, "b", 0.0, "r2")
    assert len(plain.block_hashes) == 4
    assert set(plain.block_hashes).isdisjoint(salted.block_hashes)
    assert policy.index("a").overlap(salted.block_hashes, 0.0) == 0
    assert policy.index("b").overlap(salted.block_hashes, 0.0) == 4
    assert policy.index("b").overlap(other.block_hashes, 0.0) == 0
    assert policy.rank(plain, loads(a=1, b=0), 0.0)[0] == "a"


def test_router_hashes_equal_the_engines_hashes() -> None:
    """The uint64 route hashes are the engine's block hashes in event form, an adapter's
    hashed with the path the replicas were given (vLLM's ("lora", name, path) key)."""
    hasher = BlockHasher("sha256")
    tokens = tuple(range(9))
    spec = RequestSpec("r", tokens, lora_name="adapter")
    route = route_request(spec, hasher, 4, {"adapter": "/adapters/a"})
    keys = BlockKeyInputs(lora_name="adapter", lora_path="/adapters/a")
    engine = Request("r", tokens, block_hasher=RequestBlockHasher(hasher, 4), hash_keys=keys)
    assert route.block_hashes == tuple(int.from_bytes(h[-8:], "big") for h in engine.block_hashes)
    elsewhere = route_request(spec, hasher, 4, {"adapter": "/adapters/b"})
    assert set(elsewhere.block_hashes).isdisjoint(route.block_hashes)


def test_router_hashes_of_an_image_prompt_equal_the_engines() -> None:
    """A chat's images go with its token ids: the route hashes carry each image's
    identifier from the block it starts in, as the engine's do, so another image at the same
    place is another prefix from there on, and the blocks before it are shared."""
    hasher = BlockHasher("sha256")
    tokens = tuple(range(20))
    cat = ImageInput("cat", 6, 10)
    route = route_request(RequestSpec("r", tokens, images=(cat,)), hasher, 4)
    keys = BlockKeyInputs(mm_features=(MultiModalFeature("cat", 6, 10),))
    engine = Request("r", tokens, block_hasher=RequestBlockHasher(hasher, 4), hash_keys=keys)
    assert route.block_hashes == tuple(int.from_bytes(h[-8:], "big") for h in engine.block_hashes)
    dog = route_request(RequestSpec("r", tokens, images=(ImageInput("dog", 6, 10),)), hasher, 4)
    assert dog.block_hashes[0] == route.block_hashes[0]
    assert set(dog.block_hashes[1:]).isdisjoint(route.block_hashes)


def test_a_forgotten_replica_is_never_chosen_and_loses_its_index() -> None:
    """A dead replica leaves the candidates, and its mirror is dropped: when a replica of the
    same id returns, it starts empty."""
    policy = kv_policy(1.0, {"a": HASHES})
    policy.forget("a")
    assert policy.rank(RouteRequest(HASHES), loads(b=3), 0.0) == ["b"]
    assert policy.index("a").num_blocks == 0


def test_round_robin_takes_turns_in_id_order() -> None:
    """Each request starts one further along the sorted candidates."""
    policy = RoundRobinPolicy()
    candidates = loads(b=0, a=5, c=0)
    firsts = [policy.rank(RouteRequest(()), candidates, 0.0)[0] for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]


def test_power_of_two_ranks_two_distinct_candidates_less_loaded_first() -> None:
    """Two different replicas, the one with fewer requests first, whatever the seed."""
    policy = PowerOfTwoPolicy(seed=3)
    candidates = loads(a=3, b=1, c=2, d=0)
    for _ in range(20):
        first, second = policy.rank(RouteRequest(()), candidates, 0.0)
        by_id = dict(candidates)
        assert first != second and by_id[first] <= by_id[second]


def test_text_tree_counts_shared_prefixes_once() -> None:
    """Size = symbols a prefix tree would hold; match = the longest common prefix."""
    tree = TextTree()
    tree.insert("hello world")
    tree.insert("hello there")
    tree.insert("hello world")  # already there: no growth
    assert tree.num_symbols == 11 + 5
    assert (tree.match("hello wor!"), tree.match("help"), tree.match("x")) == (9, 3, 0)


def test_text_prefix_follows_matches_and_fills_small_trees() -> None:
    """Ray Serve LLM's rule: a match of >= 10% goes to the best-matching replica; below, to
    the replica with the smallest tree; over the imbalance threshold, power of two."""
    policy = TextPrefixPolicy(imbalanced_threshold=2, seed=0)
    system = RouteRequest((), "system prompt: be brief. question one")
    policy.on_routed(system, "a", 0.0, "r1")
    follow_up = RouteRequest((), "system prompt: be brief. question two")
    assert policy.rank(follow_up, loads(a=1, b=0), 0.0) == ["a"]
    unrelated = RouteRequest((), "zzz")
    assert policy.rank(unrelated, loads(a=0, b=0), 0.0) == ["b"]
    ranked = policy.rank(follow_up, loads(a=5, b=0), 0.0)
    assert ranked == ["b", "a"]  # imbalanced: both candidates, the less loaded first


def test_unknown_router_is_refused() -> None:
    """A typo in --router is a config error naming the choices."""
    with pytest.raises(InvalidConfigError, match="kv, pow2, round-robin, text-prefix"):
        make_policy("random", 16)


def test_the_shared_tier_scores_between_held_and_computed() -> None:
    """Ten blocks: `a` holds the first 4 itself, `b` wrote all 10 to the shared tier (medium
    REMOTE: any replica can load them). a: 2 x (4 + 0.9 x 6) = 18.8, b: 2 x (0.9 x 10) = 18,
    so `a` wins while the queues are even; one block queued on `a` hands the request to `b`,
    where without the shared tier `a` would keep it until its queue passed 8."""
    policy = kv_policy(weight=2.0, holdings={"a": (1, 2, 3, 4)})
    remote = BlockStored(list(range(1, 11)), None, [], 4, None, "REMOTE", None)
    policy.index("b").apply([KVEventBatch(ts=0.0, events=[remote])])
    request = RouteRequest(tuple(range(1, 11)))
    scores = {s.replica_id: s for s in policy.scores(request, loads(a=0, b=0), 0.0)}
    assert (scores["a"].overlap, scores["a"].shared) == (4, 6)
    assert (scores["b"].overlap, scores["b"].shared) == (0, 10)
    assert [round(scores[r].value, 6) for r in "ab"] == [18.8, 18.0]
    assert policy.rank(request, loads(a=0, b=0), 0.0)[0] == "a"
    queue(policy, "a", 1, "q1")
    assert policy.rank(request, loads(a=0, b=0), 0.0)[0] == "b"
    alone = kv_policy(weight=2.0, holdings={"a": (1, 2, 3, 4)})
    queue(alone, "a", 1, "q2")
    assert alone.rank(request, loads(a=0, b=0), 0.0)[0] == "a"
