"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read
and checked against the base model: each targeted projection's A and B, the scaling folded
into B (lora_alpha / r, or / sqrt(r) under rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from blockserve.errors import InvalidConfigError
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
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoRAError(InvalidConfigError):
    """An adapter that cannot be served here; the message names it and the reason."""


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
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


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
    over steps)."""
    directory = Path(path).expanduser()

    def fail(reason: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r} ({path}): {reason}")

    rank, scaling = _read_config(directory, max_rank, fail)
    try:
        opened = safe_open(str(directory / WEIGHTS), "pt")
    except Exception as exc:  # safetensors' own error for a damaged header
        raise fail(f"cannot read {WEIGHTS}: {exc}") from None
    with opened as tensors:
        pairs = _pair_keys(tensors, arch, fail)
        weights = {}
        for (layer, module), (a_key, b_key) in pairs.items():
            a, b = tensors.get_tensor(a_key), tensors.get_tensor(b_key)
            up = (b.float() * scaling).t().to(dtype).contiguous()
            weights[(layer, module)] = (a.t().to(dtype).contiguous(), up)
            yield None
    yield LoRAAdapter(name=name, path=str(directory), rank=rank, weights=weights)


def _read_config(
    directory: Path, max_rank: int, fail: Callable[[str], LoRAError]
) -> tuple[int, float]:
    """The adapter's rank and scaling, its files and options checked."""
    config_path = directory / "adapter_config.json"
    if not directory.is_dir():
        raise fail("no such directory")
    if not config_path.is_file() or not (directory / WEIGHTS).is_file():
        raise fail("expected adapter_config.json and adapter_model.safetensors (PEFT's format)")
    config = json.loads(config_path.read_text())
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 0 < rank <= max_rank:
        raise fail(f"rank {rank} is above --max-lora-rank {max_rank}" if rank > 0 else "rank 0")
    for key, allowed in UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise fail(f"{key}={config.get(key)!r} is not supported")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pair_keys(
    tensors: Any, arch: LlamaArchConfig, fail: Callable[[str], LoRAError]
) -> dict[tuple[int, str], tuple[str, str]]:
    """Each targeted (layer, module)'s A and B tensor names, their shapes checked (read from
    the file's header: no weight is read)."""
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    names: list[str] = tensors.keys()  # safe_open's, from the header
    for key in names:
        match = _KEY.fullmatch(key)
        if match is None:
            raise fail(f"a tensor this engine cannot place: {key}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or layer >= arch.num_layers:
            raise fail(f"targets {module} of layer {layer}, which the model lacks")
        halves.setdefault((layer, module), {})[half] = key
    pairs = {}
    for (layer, module), pair in halves.items():
        fan_in, fan_out = shapes[module]
        if "A" not in pair or "B" not in pair:
            raise fail(f"{module} of layer {layer} lacks its lora_{'B' if 'A' in pair else 'A'}")
        a = tensors.get_slice(pair["A"]).get_shape()
        b = tensors.get_slice(pair["B"]).get_shape()
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
            raise fail(
                f"{module} of layer {layer} has A {list(a)} and B {list(b)}; the "
                f"model needs A [r, {fan_in}] and B [{fan_out}, r]"
            )
        pairs[(layer, module)] = (pair["A"], pair["B"])
    if not pairs:
        raise fail("holds no LoRA weights")
    return pairs
