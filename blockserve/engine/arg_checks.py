"""The checks of single engine options' values (engine/args.py declares which option takes
which): each returns None for a good value, else what is wrong with it."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import urlsplit

from blockserve.events.config import KVEventsConfig
from blockserve.kv_tiers.shared import SCHEMES
from blockserve.lora.names import check_lora_name


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


def lora_module(value: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON form: (name, path); ValueError with what is wrong."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc.msg}") from None
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("path"):
            raise ValueError(f"needs a name and a path, got {value}")
        return check_lora_name(str(entry["name"])), str(entry["path"])
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected name=path, got {value!r}")
    return check_lora_name(name), path


def lora_modules(values: Any) -> str | None:
    if not isinstance(values, (tuple, list)):
        return f"must be a list of name=path entries, got {values!r}"
    try:
        names = [lora_module(str(value))[0] for value in values]
    except ValueError as exc:
        return str(exc)
    repeated = sorted({name for name in names if names.count(name) > 1})
    return f"names {', '.join(repeated)} twice" if repeated else None


def one_device(value: int) -> str | None:
    if value == 1:
        return None
    return (
        f"must be 1, got {value}: this engine runs one device per replica; serve more "
        "devices as replicas (blockserve serve --replicas N)"
    )


def chunked_prefill(value: bool) -> str | None:
    if value:
        return None
    return "cannot be turned off: prompts over --max-num-batched-tokens are always chunked"


def no_swap_space(value: float | None) -> str | None:
    if value is None:
        return None
    return (
        "is not a flag of vLLM 0.32 either: preemption recomputes, and blocks leaving the "
        "device go to the host tier (--kv-offloading-size GiB)"
    )


def redis_url(value: str | None) -> str | None:
    """A shared store's URL, of a scheme a store serves (kv_tiers/shared.py): redis://,
    rediss:// or unix:// (what redis-py reads)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.split("://", 1)[0] not in SCHEMES:
        *first, last = (f"{scheme}://" for scheme in SCHEMES)
        return f"must be a {', '.join(first)} or {last} URL"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsed for its ValueError
    except ValueError as exc:  # an unclosed [ of an IPv6 host, a port out of range
        return f"is not a URL that can be read ({exc})"
    if parts.scheme != "unix" and not parts.hostname:
        return "names no host"
    return None
