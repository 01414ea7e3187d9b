"""`KVEventsConfig`: vLLM's `--kv-events-config` keys, parsed and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from blockserve.errors import InvalidConfigError


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV events are published.

    `publisher` is "null" (events off) or "zmq". An endpoint with `*`, `::`, `ipc://` or
    `inproc://` is bound; any other is connected to (vLLM's rule). `hash_format` is
    blockserve's addition: "uint64" (vLLM's form) or "bytes" (the raw digest).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    hash_format: str = "uint64"

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise InvalidConfigError(f"publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if self.hash_format not in ("uint64", "bytes"):
            raise InvalidConfigError(
                f"hash_format must be 'uint64' or 'bytes', got {self.hash_format!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse `--kv-events-config`; unknown keys and bad JSON raise InvalidConfigError."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidConfigError("must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        """The config from vLLM's keys; unknown keys raise InvalidConfigError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidConfigError(f"unknown keys: {', '.join(unknown)}")
        return cls(**data)
