"""The ZMQ publisher over real sockets on 127.0.0.1: content, replay, wire format, robustness."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from blockserve import LLM, SamplingParams
from blockserve.bench.server_process import free_port
from blockserve.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from blockserve.core.hashing import HASH_FUNCTIONS, block_hash_to_uint64, hash_block_tokens
from blockserve.events.config import KVEventsConfig
from blockserve.events.subscriber import CacheMirror, KVEventSubscriber
from blockserve.events.zmq_publisher import ZmqEventPublisher

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def events_config(**overrides: object) -> KVEventsConfig:
    values: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    values.update(overrides)
    # Endpoints with an explicit address are connected to by vLLM's rule; bind with "*".
    values["endpoint"] = str(values["endpoint"]).replace("127.0.0.1", "*")
    return KVEventsConfig(**values)  # type: ignore[arg-type]


def connect_address(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


def drain(subscriber: KVEventSubscriber, idle_ms: int = 300) -> list[tuple[int, KVEventBatch]]:
    """Everything the subscriber receives until the stream is idle for `idle_ms`."""
    received: list[tuple[int, KVEventBatch]] = []
    while batch := subscriber.poll(timeout_ms=idle_ms):
        received.extend(batch)
    return received


@pytest.fixture
def llm_with_events(tiny_llama_dir: Path) -> Iterator[tuple[LLM, KVEventsConfig]]:
    config = events_config()
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, kv_events_config=config
    )
    yield llm, config
    llm.shutdown()


def subscribe(config: KVEventsConfig) -> KVEventSubscriber:
    assert config.replay_endpoint is not None
    subscriber = KVEventSubscriber(
        connect_address(config.endpoint), connect_address(config.replay_endpoint)
    )
    time.sleep(0.5)  # let the SUB connection settle (a late join is tested separately)
    return subscriber


@pytest.mark.slow
def test_identical_requests_store_once(llm_with_events: tuple[LLM, KVEventsConfig]) -> None:
    """Two identical 33-token requests: one BlockStored with 2 hashes, nothing for the second."""
    llm, config = llm_with_events
    subscriber = subscribe(config)
    try:
        prompt = list(range(10, 43))
        llm.generate(prompt, GREEDY, use_tqdm=False)
        llm.generate(prompt, GREEDY, use_tqdm=False)
        received = drain(subscriber)
    finally:
        subscriber.close()
    events = [event for _, batch in received for event in batch.events]
    assert [seq for seq, _ in received] == list(range(len(received)))
    assert all(batch.data_parallel_rank == 0 for _, batch in received)
    (stored,) = events
    assert isinstance(stored, BlockStored)
    fn = HASH_FUNCTIONS["sha256"]
    none_hash = fn("vllm-none-hash")
    h0 = hash_block_tokens(fn, none_hash, prompt[:16])
    h1 = hash_block_tokens(fn, h0, prompt[16:32])
    assert stored == BlockStored(
        block_hashes=[block_hash_to_uint64(h0), block_hash_to_uint64(h1)],
        parent_block_hash=None,
        token_ids=prompt[:32],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None, None],
    )


@pytest.mark.slow
def test_eviction_and_reset_events(llm_with_events: tuple[LLM, KVEventsConfig]) -> None:
    """Pressure on an 11-block pool evicts: one BlockRemoved per evicted hash; reset clears."""
    llm, config = llm_with_events
    subscriber = subscribe(config)
    mirror = CacheMirror()
    try:
        for start in range(0, 280, 40):  # 7 distinct 40-token prompts: 2 cached blocks each
            llm.generate(list(range(start, start + 40)), GREEDY, use_tqdm=False)
        received = drain(subscriber)
        mirror.apply(batch for _, batch in received)
        pool = llm.engine.core.kv_cache_manager.block_pool
        assert mirror.hashes == {
            block_hash_to_uint64(h) for h in pool.cached_block_hash_to_block.hashes()
        }
        stored = [
            h
            for _, b in received
            for e in b.events
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        ]
        removed = [e for _, b in received for e in b.events if isinstance(e, BlockRemoved)]
        assert removed and all(len(e.block_hashes) == 1 for e in removed)
        evicted = [e.block_hashes[0] for e in removed]
        assert len(set(evicted)) == len(evicted) and set(evicted) <= set(stored)
        assert pool.num_evictions == len(evicted)
        assert llm.reset_prefix_cache() is True
        (cleared_batch,) = drain(subscriber)
        assert cleared_batch[1].events == [AllBlocksCleared()]
    finally:
        subscriber.close()


@pytest.mark.slow
def test_late_joiner_recovers_through_replay(llm_with_events: tuple[LLM, KVEventsConfig]) -> None:
    """A subscriber that joins after 3 batches gets them by replay, in order, then live ones."""
    llm, config = llm_with_events
    for start in (0, 50, 100):
        llm.generate(list(range(start, start + 20)), GREEDY, use_tqdm=False)
    time.sleep(0.2)
    subscriber = subscribe(config)
    try:
        llm.generate(list(range(200, 220)), GREEDY, use_tqdm=False)
        received = drain(subscriber)
    finally:
        subscriber.close()
    assert [seq for seq, _ in received] == [0, 1, 2, 3]
    assert subscriber.num_replayed == 3
    first_tokens = [b.events[0].token_ids[0] for _, b in received]  # type: ignore[union-attr]
    assert first_tokens == [0, 50, 100, 200]


def test_plain_msgpack_decoding_gives_the_documented_structure() -> None:
    """A consumer without blockserve's classes sees [ts, [{"type": ...}], rank] on the wire."""
    config = events_config(hash_format="bytes")
    publisher = ZmqEventPublisher(config)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(connect_address(config.endpoint))
    time.sleep(0.5)
    try:
        digest = bytes(range(32))
        publisher.publish(
            KVEventBatch(
                ts=1.0,
                events=[
                    BlockStored(
                        block_hashes=[digest],
                        parent_block_hash=None,
                        token_ids=[1, 2],
                        block_size=2,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                ],
                data_parallel_rank=0,
            )
        )
        assert sub.poll(2000)
        topic, seq, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        context.term()
        publisher.shutdown()
    assert (topic, seq) == (b"", (0).to_bytes(8, "big"))
    assert msgspec.msgpack.decode(payload) == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [digest],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ],
        0,
    ]


def test_full_queue_and_absent_subscriber_never_block() -> None:
    """With a 1-slot queue and nobody listening, publish drops the live copy instead of
    waiting, and every batch stays replayable."""
    config = events_config(max_queue_size=1, buffer_steps=5000)
    publisher = ZmqEventPublisher(config)
    batch = KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=0)
    for _ in range(5000):
        publisher.publish(batch)
    assert publisher.num_dropped_live > 0  # the queue was full: publish did not wait
    assert config.replay_endpoint is not None
    subscriber = KVEventSubscriber(
        connect_address(config.endpoint), connect_address(config.replay_endpoint)
    )
    try:
        replayed = subscriber.replay(0)
    finally:
        subscriber.close()
        publisher.shutdown()
    assert [seq for seq, _ in replayed] == list(range(5000))


def test_a_connecting_endpoint_with_no_listener_is_logged_with_the_bind_form(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host in the endpoint makes the publisher connect (vLLM's rule): with nothing bound
    there, the start says so and names the * form; with a subscriber bound there, it says
    where the events go."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with caplog.at_level(logging.INFO, logger="blockserve.events.zmq_publisher"):
        ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)).shutdown()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"KV events: {endpoint} names a host, so the publisher connects to it (vLLM's rule) "
            "and nothing listens there: events are dropped until a subscriber binds it. For "
            f"subscribers to connect to this server, use tcp://*:{port}",
        )
    ]
    caplog.clear()
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.bind(endpoint)
    try:
        with caplog.at_level(logging.INFO, logger="blockserve.events.zmq_publisher"):
            config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
            ZmqEventPublisher(config).shutdown()
    finally:
        subscriber.close(linger=0)
        context.term()
    assert [r.getMessage() for r in caplog.records] == [
        f"KV events: the publisher connects to the subscriber bound at {endpoint}"
    ]
