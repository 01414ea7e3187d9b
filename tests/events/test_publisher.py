"""The publisher factory: null when events are off, ZMQ when asked; null drops everything."""

from __future__ import annotations

from blockserve.bench.server_process import free_port
from blockserve.core.events import AllBlocksCleared, KVEventBatch
from blockserve.events.config import KVEventsConfig
from blockserve.events.publisher import NullEventPublisher, create_event_publisher
from blockserve.events.zmq_publisher import ZmqEventPublisher


def test_events_off_give_the_null_publisher() -> None:
    """No config, or a config with events off, publishes nothing and holds no socket."""
    for config in (None, KVEventsConfig(), KVEventsConfig(publisher="zmq")):
        publisher = create_event_publisher(config)
        assert isinstance(publisher, NullEventPublisher)
        batch = KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=0)
        assert publisher.publish(batch) is None and publisher.shutdown() is None


def test_events_on_give_a_zmq_publisher() -> None:
    """enable_kv_cache_events with publisher "zmq" binds a ZMQ publisher (shut down here)."""
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{free_port()}"
    )
    publisher = create_event_publisher(config)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
    finally:
        publisher.shutdown()
