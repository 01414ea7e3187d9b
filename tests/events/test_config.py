"""KVEventsConfig: vLLM's `--kv-events-config` keys, parsed and checked."""

from __future__ import annotations

import pytest

from blockserve.errors import InvalidConfigError
from blockserve.events.config import KVEventsConfig


def test_config_parsing() -> None:
    """vLLM's keys parse; unknown keys, bad JSON and bad values are typed errors."""
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
    )
    assert (config.enabled, config.topic, config.buffer_steps, config.hwm) == (
        True,
        "kv-events",
        10_000,
        100_000,
    )
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled
    for text, message in [
        ("{", "not valid JSON"),
        ('{"endpont": "x"}', "unknown keys: endpont"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
    ]:
        with pytest.raises(InvalidConfigError, match=message):
            KVEventsConfig.from_json(text)


def test_enabled_needs_the_flag_and_a_real_publisher() -> None:
    """Events are on only with enable_kv_cache_events and a publisher other than null."""
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="zmq").enabled
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled
    assert not KVEventsConfig(publisher="zmq").enabled
