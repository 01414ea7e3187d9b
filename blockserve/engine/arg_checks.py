"""The checks of the options `EngineArgs` declares itself (the configs' options carry theirs):
each returns None for a good value, else what is wrong with it."""

from __future__ import annotations

import json
from typing import Any

from blockserve.events.config import KVEventsConfig
from blockserve.lora.names import check_lora_name


def kv_events(value: Any) -> str | None:
    if value is None or isinstance(value, (str, dict, KVEventsConfig)):
        return None
    return f"must be a JSON string, a dict or a KVEventsConfig, got {type(value).__name__}"


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


def image_limit(value: dict | str | None) -> int:
    """`--limit-mm-per-prompt`'s image count (999 when not given, vLLM's default); ValueError
    with what is wrong."""
    if value is None:
        return 999
    limits = json.loads(value) if isinstance(value, str) else value
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        keys = sorted(map(str, limits)) if isinstance(limits, dict) else type(limits).__name__
        raise ValueError(f"takes 'image' alone, got {keys}")
    count = limits.get("image", 999)
    count = count.get("count") if isinstance(count, dict) else count
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"needs a count >= 0 of images, got {count!r}")
    return count


def mm_limit(value: Any) -> str | None:
    try:
        image_limit(value)
    except json.JSONDecodeError as exc:
        return f"is not JSON: {exc.msg}"
    except ValueError as exc:
        return str(exc)
    return None
