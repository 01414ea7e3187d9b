"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read
and checked against the base model: each targeted projection's A and B, the scaling folded
into B (lora_alpha / r, or / sqrt(r) under rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

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
    directory = Path(path).expanduser()

    def fail(reason: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r} ({path}): {reason}")

    config_path = directory / "adapter_config.json"
    weights_path = directory / "adapter_model.safetensors"
    if not directory.is_dir():
        raise fail("no such directory")
    if not config_path.is_file() or not weights_path.is_file():
        raise fail("expected adapter_config.json and adapter_model.safetensors (PEFT's format)")
    config = json.loads(config_path.read_text())
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 0 < rank <= max_rank:
        raise fail(f"rank {rank} is above --max-lora-rank {max_rank}" if rank > 0 else "rank 0")
    for key, allowed in UNSUPPORTED.items():
        if config.get(key) not in allowed:
            raise fail(f"{key}={config.get(key)!r} is not supported")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(str(weights_path))
    return LoRAAdapter(
        name=name, path=str(directory), rank=rank,
        weights=_pair_weights(tensors, arch, scaling, dtype, fail),
    )  # fmt: skip


def _pair_weights(
    tensors: dict[str, torch.Tensor],
    arch: LlamaArchConfig,
    scaling: float,
    dtype: torch.dtype,
    fail: Callable[[str], LoRAError],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise fail(f"a tensor this engine cannot place: {key}")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or layer >= arch.num_layers:
            raise fail(f"targets {module} of layer {layer}, which the model lacks")
        halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in halves.items():
        fan_in, fan_out = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise fail(f"{module} of layer {layer} lacks its lora_{'B' if b is None else 'A'}")
        if a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise fail(
                f"{module} of layer {layer} has A {list(a.shape)} and B {list(b.shape)}; the "
                f"model needs A [r, {fan_in}] and B [{fan_out}, r]"
            )
        down = a.t().to(dtype).contiguous()
        up = (b.float() * scaling).t().to(dtype).contiguous()
        weights[(layer, module)] = (down, up)
    if not weights:
        raise fail("holds no LoRA weights")
    return weights
