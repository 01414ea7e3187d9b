"""Default sampling parameters from the model's `generation_config.json`, as vLLM reads them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from blockserve.errors import InvalidConfigError

# `--generation-config auto` (the default) reads the file in the model's directory; `vllm` reads
# nothing (every default is the API's); any other value is a directory holding the file, or the
# file itself. Of the file, the keys that shape sampling are kept: `temperature`, `top_p`,
# `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens`, which becomes `max_tokens`. A
# request's own value wins over each; `max_tokens` is a cap as well as a default (vLLM gives a
# request the least of its own `max_tokens`, the room left in the context and this value).

# generation_config.json's key -> the request field it is the default of
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FILE_NAME = "generation_config.json"


def default_sampling(model_dir: Path, setting: str) -> dict[str, float | int]:
    """The defaults `setting` ("auto", "vllm" or a path) gives; InvalidConfigError for a path
    with no readable file or a file with a value of the wrong type."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = model_dir / FILE_NAME
        if not path.is_file():
            return {}
    else:
        path = Path(setting)
        if path.is_dir():
            path = path / FILE_NAME
        if not path.is_file():
            raise InvalidConfigError(
                f"generation_config (--generation-config) {setting!r}: no {FILE_NAME} there"
            )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidConfigError(f"generation_config: {path} does not hold a JSON object")
    return {field: _number(path, key, config[key]) for key, field in _KEYS.items() if key in config}


def _number(path: Path, key: str, value: Any) -> float | int:
    integral = key in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidConfigError(f"generation_config: {key} in {path} is {value!r}, not a number")
    if integral and not float(value).is_integer():
        raise InvalidConfigError(f"generation_config: {key} in {path} is {value!r}, not an integer")
    return int(value) if integral else float(value)
