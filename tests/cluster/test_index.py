"""A router's index of one replica, fed by that replica's real event stream: equal to its
pool after random traffic, lost batches recovered by replay, unrecoverable ones reset (the
events' part; the router's credits stand)."""

from __future__ import annotations

import random
import time

import pytest

from blockserve.cluster.index import PrefixIndex
from blockserve.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
)
from blockserve.core.hashing import BlockHasher, block_hash_to_uint64
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.events.subscriber import KVEventSubscriber, ReplayUnavailableError
from blockserve.events.zmq_publisher import ZmqEventPublisher
from blockserve.replay.simulate import ReplayRequest
from tests.events.test_zmq_publisher import connect_address, drain, events_config

BLOCK_SIZE = 4
HASHER = BlockHasher("sha256")


def run_prompt(manager: KVCacheManager, request_id: str, tokens: list[int]) -> int:
    """Allocate a prompt (its hits included), cache its full blocks, free it; its hit blocks."""
    block_hashes = HASHER.hash_prompt(tokens, BLOCK_SIZE)
    request = ReplayRequest(request_id, block_hashes, len(tokens), all_token_ids=tokens)
    hit_blocks, num_hits = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - num_hits, num_hits, hit_blocks)
    request.num_computed_tokens = len(tokens)
    manager.free(request)
    return num_hits // BLOCK_SIZE


def random_prompt(rng: random.Random) -> list[int]:
    """One of 4 shared prefixes of 0-3 blocks, then 1-8 tokens of its own."""
    prefix = [100 * rng.randrange(4) + i for i in range(BLOCK_SIZE * rng.randrange(4))]
    return prefix + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]


def pool_hashes(manager: KVCacheManager) -> set[int]:
    cached = manager.block_pool.cached_block_hash_to_block.hashes()
    return {block_hash_to_uint64(h) for h in cached}


@pytest.mark.slow
def test_index_equals_the_pool_after_random_traffic_with_lost_batches() -> None:
    """200 random prompts through an 11-block pool, one event batch each, published through a
    send queue of 1 so that most batches are not sent live: the subscriber fills every gap by
    replay once a later batch reveals it, and the index ends equal to the pool, hash for hash."""
    config = events_config(max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    subscriber = KVEventSubscriber(
        connect_address(config.endpoint), connect_address(str(config.replay_endpoint))
    )
    recorder = KVEventRecorder()
    manager = KVCacheManager(12, BLOCK_SIZE, True, recorder)
    index = PrefixIndex(max_credits=11)
    rng = random.Random(7)
    try:
        time.sleep(0.3)  # the SUB socket joins
        for number in range(200):
            run_prompt(manager, str(number), random_prompt(rng))
            publisher.publish(KVEventBatch(ts=float(number), events=recorder.take()))
        # A gap shows only when a later batch arrives live: the replica's next step.
        time.sleep(0.2)
        publisher.publish(KVEventBatch(ts=200.0, events=[]))
        received = drain(subscriber)
    finally:
        subscriber.close()
        publisher.shutdown()
    index.apply(batch for _, batch in received)
    assert [seq for seq, _ in received] == list(range(201))
    assert publisher.num_dropped_live > 0 and subscriber.num_replayed > 0
    assert index.mirror.hashes == pool_hashes(manager)
    assert manager.block_pool.num_evictions > 0
    for _ in range(50):  # the index predicts the pool's hits exactly
        tokens = random_prompt(rng)
        hashes = [block_hash_to_uint64(h) for h in HASHER.hash_prompt(tokens, BLOCK_SIZE)]
        probe = ReplayRequest("probe", HASHER.hash_prompt(tokens, BLOCK_SIZE), len(tokens) + 4)
        _, num_hits = manager.get_computed_blocks(probe)
        assert index.overlap(hashes, now=0.0) == num_hits // BLOCK_SIZE


@pytest.mark.slow
def test_unrecoverable_gap_names_where_to_resume() -> None:
    """A subscriber joining after the replay buffer (4 batches) has moved past seq 0 gets a
    ReplayUnavailableError naming the live batch to resume from; the next poll goes on from
    there, filling later gaps as usual."""
    config = events_config(buffer_steps=4)
    publisher = ZmqEventPublisher(config)
    event = BlockStored([1], None, [], 4, None, "GPU", None)
    for number in range(10):  # sent before the subscriber exists: lost to it
        publisher.publish(KVEventBatch(ts=float(number), events=[event]))
    time.sleep(0.3)  # the sender thread sends them
    subscriber = KVEventSubscriber(
        connect_address(config.endpoint), connect_address(str(config.replay_endpoint))
    )
    try:
        time.sleep(0.3)  # the SUB socket joins
        publisher.publish(KVEventBatch(ts=10.0, events=[event]))
        with pytest.raises(ReplayUnavailableError) as caught:
            drain(subscriber)
        publisher.publish(KVEventBatch(ts=11.0, events=[event]))
        received = drain(subscriber)
    finally:
        subscriber.close()
        publisher.shutdown()
    assert caught.value.resume_seq == 10
    assert [seq for seq, _ in received] == [10, 11]


def test_lower_tiers_keep_hashes_through_a_device_reset() -> None:
    """A hash held on the CPU tier counts after the device copy is evicted; a prefix-cache
    reset empties the device tier only; `clear` (replica gone) empties all."""
    index = PrefixIndex(max_credits=8)
    index.apply(
        [
            KVEventBatch(
                ts=0.0,
                events=[
                    BlockStored([1, 2], None, [], 4, None, "GPU", None),
                    BlockStored([1], None, [], 4, None, "CPU", None),
                    BlockRemoved([1, 2], "GPU"),
                ],
            )
        ]
    )
    assert (index.overlap([1, 2], 0.0), index.num_blocks) == (1, 1)
    index.apply([KVEventBatch(ts=1.0, events=[BlockStored([3], None, [], 4, None, "GPU", None)])])
    index.apply([KVEventBatch(ts=2.0, events=[AllBlocksCleared()])])
    assert (index.mirror.hashes, index.mirror.lower) == (set(), {"CPU": {1}})
    index.clear()
    assert index.num_blocks == 0


def test_lost_events_reset_what_the_events_said_and_keep_the_credits() -> None:
    """An unrecoverable gap (`clear_events`) empties the mirror, every tier of it; blocks just
    routed to the replica stay credited until they expire; `clear` (replica gone) drops both."""
    index = PrefixIndex(max_credits=8, credit_ttl_s=10.0)
    stored = [BlockStored([1, 2], None, [], 4, None, "GPU", None),
              BlockStored([3], None, [], 4, None, "CPU", None)]  # fmt: skip
    index.apply([KVEventBatch(ts=0.0, events=stored)])
    index.credit([7, 8], now=0.0)
    assert (index.overlap([1, 2], 1.0), index.overlap([7, 8], 1.0)) == (2, 2)
    index.clear_events()
    assert (index.num_blocks, index.num_credits) == (0, 2)
    assert [index.overlap(hashes, 1.0) for hashes in ([1, 2], [3], [7, 8])] == [0, 0, 2]
    assert index.overlap([7, 8], 11.0) == 0  # expired
    index.credit([7], now=12.0)
    index.clear()
    assert (index.num_blocks, index.num_credits) == (0, 0)
