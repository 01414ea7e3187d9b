"""`LlamaArchConfig`: the shape of a Llama-family decoder, read from a Hugging Face config.json.
Accepts both config layouts in the wild: `rope_theta` / `rope_scaling` (transformers 4) and
`rope_parameters` (transformers 5). Rejects architectures and RoPE types it cannot run, with a
typed error, instead of computing something subtly wrong."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blockserve.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# Vision-language models whose text half is one of those: its `text_config` is read.
VISION_LANGUAGE_TYPES = frozenset({"smolvlm", "idefics3"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "llama3"})


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1+): long wavelengths are slowed by `factor`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LlamaArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaArchConfig:
        if config.get("model_type") in VISION_LANGUAGE_TYPES:  # the text half's shape
            return cls.from_hf(config["text_config"])
        model_type = config.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; blockserve runs "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _read_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them (and an o_proj bias) when asked.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            eos_token_ids=eos_ids,
        )


def _read_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters")
    if params is None:  # transformers 4 layout
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported; blockserve runs "
            f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
