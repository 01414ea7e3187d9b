"""The checks of single engine options' values (engine/args.py declares which option takes
which): each returns None for a good value, else what is wrong with it."""

from __future__ import annotations

import math
from typing import Any

from blockserve.events.config import KVEventsConfig


def device(value: str) -> str | None:
    name, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (name == "cuda" and index.isdigit()):
        return None
    return f"must be auto, cpu, cuda or cuda:N, got {value!r}"


def finite_non_negative(value: float) -> str | None:
    if math.isfinite(value) and value >= 0:
        return None
    return f"must be a finite number >= 0, got {value!r}"


def non_empty(value: str) -> str | None:
    return None if value else "must be auto, vllm or a path, got an empty string"


def kv_events(value: Any) -> str | None:
    if value is None or isinstance(value, (str, dict, KVEventsConfig)):
        return None
    return f"must be a JSON string, a dict or a KVEventsConfig, got {type(value).__name__}"


def graph_sizes(values: Any) -> str | None:
    if not isinstance(values, (tuple, list)):
        return f"must be a list of batch sizes, got {values!r}"
    if all(str(v).isdigit() and int(v) > 0 and not isinstance(v, bool) for v in values):
        return None
    return f"must be positive batch sizes, got {' '.join(map(str, values))}"


def share(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value:g}"


def non_empty_or_none(value: str | None) -> str | None:
    return None if value is None or value else "must not be empty"
