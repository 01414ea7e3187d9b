"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read
and checked against the base model: each targeted projection's A and B, the scaling folded
into B (lora_alpha / r, or / sqrt(r) under rsLoRA)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from blockserve.lora.names import LoRAError, check_lora_name
from blockserve.model.arch import LlamaArchConfig

# PEFT's module names, as this engine's fused projections hold them.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT options whose other values change what the weights mean: only these values are served.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "fan_in_fan_out": (False, None),
}
WEIGHTS = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 16
_MAX_HEADER_BYTES = 1 << 23
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: which adapter a request runs under (`lora_int_id` > 0, unique per adapter)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """`weights[(layer, module)] = (A [in, r], B [r, out] × scaling)`, ready to multiply."""

    name: str
    path: str  # as given (vLLM's `lora_path`: a key of the adapter's block hashes)
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""  # SHA-256 of its config and weight files, as read


def module_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT module name in this model."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def load_adapter(
    name: str, path: str, arch: LlamaArchConfig, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter at `path`, checked: LoRAError (naming `name`) when it cannot be served."""
    for adapter in read_in_parts(name, path, arch, max_rank, dtype):
        if adapter is not None:
            return adapter
    raise AssertionError("read_in_parts ends with the adapter")


def read_in_parts(
    name: str, path: str, arch: LlamaArchConfig, max_rank: int, dtype: torch.dtype
) -> Iterator[LoRAAdapter | None]:
    """`load_adapter` a module at a time: every check first (LoRAError), then None after each
    module's weights are read and converted, then the adapter (a caller spreads the parts
    over steps). No weight is read before the file's header has been checked whole: every
    tensor's name, dtype, shape (against the model and the config's `r`) and byte range."""
    check_lora_name(name)

    def fail(reason: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r} ({path[:200]}): {reason}")

    directory = Path(path).expanduser()
    config_bytes = _read_small(directory, "adapter_config.json", _MAX_CONFIG_BYTES, fail)
    rank, scaling = _parse_config(config_bytes, max_rank, fail)
    weights_path = directory / WEIGHTS
    header = _read_header(weights_path, fail)
    pairs = _pair_keys(header, arch, rank, fail)
    digest = hashlib.sha256(config_bytes)
    try:
        with weights_path.open("rb") as file:  # bounded: the header fixed the file's size
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        opened = safe_open(str(weights_path), "pt")
    except Exception as exc:  # an OSError, or safetensors' own error for a damaged file
        raise fail(f"cannot read {WEIGHTS}: {exc}") from None
    with opened as tensors:
        weights = {}
        for (layer, module), (a_key, b_key) in pairs.items():
            a, b = tensors.get_tensor(a_key), tensors.get_tensor(b_key)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                # NaN logits for its requests: arbitrary tokens, logprobs no JSON can carry.
                raise fail(f"{module} of layer {layer} has weights that are NaN or infinite")
            up = (b.float() * scaling).t().to(dtype).contiguous()
            weights[(layer, module)] = (a.t().to(dtype).contiguous(), up)
            yield None
    yield LoRAAdapter(name=name, path=path, rank=rank, weights=weights, digest=digest.hexdigest())


def _read_small(
    directory: Path, filename: str, limit: int, fail: Callable[[str], LoRAError]
) -> bytes:
    """The bytes of `directory/filename`, a regular file of at most `limit` bytes."""
    file = directory / filename
    try:
        if not directory.is_dir():
            raise fail("no such directory")
        if not file.is_file() or not (directory / WEIGHTS).is_file():
            raise fail("expected adapter_config.json and adapter_model.safetensors (PEFT's format)")
        if file.stat().st_size > limit:
            raise fail(f"{filename} is over {limit} bytes")
        with file.open("rb") as handle:
            return handle.read(limit + 1)[:limit]
    except OSError as exc:  # a name too long, a permission, a loop of links
        raise fail(f"cannot read {filename}: {exc.strerror or exc}") from None


def _parse_config(
    data: bytes, max_rank: int, fail: Callable[[str], LoRAError]
) -> tuple[int, float]:
    """The adapter's rank and scaling, its options checked."""
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise fail("adapter_config.json is not a JSON object") from None
    if not isinstance(config, dict):
        raise fail("adapter_config.json is not a JSON object")
    rank = config.get("r", 0)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise fail(f"r must be an integer, got {str(rank)[:50]}")
    if not 0 < rank <= max_rank:
        raise fail(
            f"rank {rank} is above --max-lora-rank {max_rank}" if rank > 0 else f"rank {rank}"
        )
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a finite number, got {str(alpha)[:50]}")
    for key, allowed in UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise fail(f"{key}={str(config.get(key))[:50]} is not supported")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_header(file: Path, fail: Callable[[str], LoRAError]) -> dict[str, Any]:
    """The safetensors header of `file`, checked against the file: each tensor's dtype one
    of ours, its byte range the size of its shape, the ranges packed to the file's end."""
    try:
        with file.open("rb") as handle:
            size = file.stat().st_size
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
                raise fail(f"{WEIGHTS} has no safetensors header")
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError as exc:
        raise fail(f"cannot read {WEIGHTS}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise fail(f"{WEIGHTS} has a damaged header") from None
    if not isinstance(header, dict):
        raise fail(f"{WEIGHTS} has a damaged header")
    header.pop("__metadata__", None)
    end = 0
    for key, entry in header.items():
        if not isinstance(entry, dict):
            raise fail(f"{key[:200]} has a damaged header entry")
        shape, offsets = _ints(entry.get("shape")), _ints(entry.get("data_offsets"))
        itemsize = _DTYPE_BYTES.get(str(entry.get("dtype")))
        if itemsize is None:
            raise fail(f"{key[:200]} is not a float32, float16 or bfloat16 tensor")
        if shape is None or offsets is None or len(offsets) != 2:
            raise fail(f"{key[:200]} has a damaged header entry")
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise fail(f"{key[:200]}'s bytes do not match its shape {shape}")
        end = max(end, offsets[1])
    if 8 + length + end != size:
        raise fail(f"{WEIGHTS} is {size} bytes, its header describes {8 + length + end}")
    return header


def _ints(value: Any) -> list[int] | None:
    """`value` if it is a list of integers >= 0 (a shape, a byte range), else None."""
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return value
    return None


def _pair_keys(
    header: dict[str, Any], arch: LlamaArchConfig, rank: int, fail: Callable[[str], LoRAError]
) -> dict[tuple[int, str], tuple[str, str]]:
    """Each targeted (layer, module)'s A and B tensor names, their shapes checked against the
    model and the config's rank (from the header: no weight is read)."""
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in header:
        match = _KEY.fullmatch(key)
        if match is None:
            raise fail(f"a tensor this engine cannot place: {key[:200]}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or layer >= arch.num_layers:
            raise fail(f"targets {module} of layer {layer}, which the model lacks")
        halves.setdefault((layer, module), {})[half] = key
    pairs = {}
    for (layer, module), pair in halves.items():
        fan_in, fan_out = shapes[module]
        if "A" not in pair or "B" not in pair:
            raise fail(f"{module} of layer {layer} lacks its lora_{'B' if 'A' in pair else 'A'}")
        a, b = header[pair["A"]]["shape"], header[pair["B"]]["shape"]
        if a != [rank, fan_in] or b != [fan_out, rank]:
            raise fail(
                f"{module} of layer {layer} has A {a} and B {b}; with r = {rank} the "
                f"model needs A [{rank}, {fan_in}] and B [{fan_out}, {rank}]"
            )
        pairs[(layer, module)] = (pair["A"], pair["B"])
    if not pairs:
        raise fail("holds no LoRA weights")
    return pairs
