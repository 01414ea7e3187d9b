"""What an adapter may be called, and the error of an adapter that cannot be served. Imports
no torch: the option checks read it."""

from __future__ import annotations

import unicodedata

from blockserve.errors import InvalidConfigError

MAX_NAME_LENGTH = 256


class LoRAError(InvalidConfigError):
    """An adapter that cannot be served here; the message names it and the reason."""


def check_lora_name(name: object) -> str:
    """`name` as an adapter may be called: LoRAError for an empty or whitespace-only name,
    one with control characters or commas (vLLM's `lora_requests_info` joins names with
    commas), or one over MAX_NAME_LENGTH characters."""
    if not isinstance(name, str) or not name.strip():
        raise LoRAError(f"a LoRA adapter needs a name that is not blank, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise LoRAError(
            f"a LoRA adapter's name is at most {MAX_NAME_LENGTH} characters, got {len(name)}"
        )
    if "," in name or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        raise LoRAError(f"a LoRA adapter's name has no commas or control characters, got {name!r}")
    return name
