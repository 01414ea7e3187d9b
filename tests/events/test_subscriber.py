"""The subscriber: in-order delivery with gaps filled by replay, the cache mirror it feeds,
and the line format of `blockserve events`."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from blockserve import LLM, SamplingParams
from blockserve.core.events import AllBlocksCleared, BlockRemoved, KVEventBatch
from blockserve.core.hashing import block_hash_to_uint64
from blockserve.events.subscriber import CacheMirror, format_event
from blockserve.events.zmq_publisher import ZmqEventPublisher
from tests.core.test_events import STORED
from tests.events.test_zmq_publisher import drain, events_config, subscribe


@pytest.mark.slow
def test_dropped_messages_are_replayed_without_duplicates() -> None:
    """Messages lost on the wire (a subscriber that skips some) come back through replay."""
    config = events_config()
    publisher = ZmqEventPublisher(config)
    assert config.replay_endpoint is not None
    subscriber = subscribe(config)
    try:
        batches = [
            KVEventBatch(
                ts=float(i),
                events=[BlockRemoved(block_hashes=[i], medium="GPU")],
                data_parallel_rank=0,
            )
            for i in range(10)
        ]
        for batch in batches[:3]:
            publisher.publish(batch)
        got = drain(subscriber)
        subscriber.next_seq = 6  # pretend 3..5 were received, then 6..9 "dropped" below
        for batch in batches[3:]:
            publisher.publish(batch)
        time.sleep(0.2)
        subscriber.next_seq = 3  # ... and now forget 3..5 again: they must come back once
        got += drain(subscriber)
    finally:
        subscriber.close()
        publisher.shutdown()
    assert [seq for seq, _ in got] == list(range(10))
    assert [b.events[0].block_hashes for _, b in got] == [[i] for i in range(10)]  # type: ignore[union-attr]


@pytest.mark.slow
def test_mirror_equals_pool_after_random_workload(tiny_llama_dir: Path) -> None:
    """After 300 random requests with shared openings, the mirror equals the pool exactly."""
    config = events_config()
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_gpu_blocks_override=40,
        kv_events_config=config,
        max_num_seqs=8,
    )
    subscriber = subscribe(config)
    mirror = CacheMirror()
    rng = random.Random(0)
    openings = [[rng.randrange(300) for _ in range(rng.choice([16, 24, 40]))] for _ in range(6)]
    try:
        for _ in range(30):
            prompts = [
                rng.choice(openings) + [rng.randrange(300) for _ in range(rng.randrange(1, 30))]
                for _ in range(10)
            ]
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True
            )
            llm.generate(prompts, params, use_tqdm=False)
            if rng.random() < 0.05:
                llm.reset_prefix_cache()
            mirror.apply(batch for _, batch in subscriber.poll(timeout_ms=20))
        mirror.apply(batch for _, batch in drain(subscriber))
        pool = llm.engine.core.kv_cache_manager.block_pool
        assert pool.num_evictions > 0
        assert mirror.hashes == {
            block_hash_to_uint64(h) for h in pool.cached_block_hash_to_block.hashes()
        }
        assert pool.integrity_errors() == []
    finally:
        subscriber.close()
        llm.shutdown()


def test_mirror_applies_stores_removals_and_clears_in_order() -> None:
    """Stored hashes are added, removed ones dropped, and a clear empties the mirror."""
    mirror = CacheMirror()
    mirror.apply([KVEventBatch(ts=0.0, events=[STORED], data_parallel_rank=0)])
    assert mirror.hashes == {11, 12}
    removed = BlockRemoved(block_hashes=[12], medium="GPU")
    mirror.apply([KVEventBatch(ts=1.0, events=[removed], data_parallel_rank=0)])
    assert mirror.hashes == {11}
    mirror.apply([KVEventBatch(ts=2.0, events=[AllBlocksCleared()], data_parallel_rank=0)])
    assert mirror.hashes == set()


def test_event_lines_summary_and_json() -> None:
    """The summary names the kind and its fields; --json prints one decodable record."""
    batch = KVEventBatch(ts=5.0, events=[STORED], data_parallel_rank=0)
    assert format_event(3, batch, STORED, as_json=False) == (
        "seq=3 BlockStored blocks=2 hashes=[11, 12] parent=None tokens=32 block_size=16 "
        "medium=GPU lora=None"
    )
    record = json.loads(format_event(3, batch, STORED, as_json=True))
    assert (record["seq"], record["ts"], record["event"]["type"]) == (3, 5.0, "BlockStored")
    assert format_event(4, batch, AllBlocksCleared(), as_json=False) == "seq=4 AllBlocksCleared"
