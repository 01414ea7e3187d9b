"""The `EventPublisher` interface and its null implementation.

The engine hands each step's `KVEventBatch` to a publisher; it must never block the step.
"""

from __future__ import annotations

from typing import Protocol

from blockserve.core.events import KVEventBatch
from blockserve.events.config import KVEventsConfig


class EventPublisher(Protocol):
    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch for delivery (never blocks on the network)."""

    def shutdown(self) -> None:
        """Deliver what is queued (within a short timeout), then release sockets."""


class NullEventPublisher:
    """Drops every batch: the default when KV events are off."""

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None


def create_event_publisher(config: KVEventsConfig | None) -> EventPublisher:
    """The publisher `config` asks for: null when events are off, else ZMQ."""
    if config is None or not config.enabled:
        return NullEventPublisher()
    from blockserve.events.zmq_publisher import ZmqEventPublisher

    return ZmqEventPublisher(config)
