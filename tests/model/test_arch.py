"""Reading Llama-family configs: both transformers layouts, RoPE scaling, refusals."""

from __future__ import annotations

import pytest

from blockserve.errors import UnsupportedModelError
from blockserve.model.arch import LlamaArchConfig, RopeScaling

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_transformers4_layout() -> None:
    """rope_theta / rope_scaling at top level (transformers 4 config files) are read."""
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    arch = LlamaArchConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": scaling})
    assert arch.rope_theta == 5e5
    assert arch.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert (arch.num_kv_heads, arch.head_dim) == (4, 16)  # defaults: MHA, hidden / heads


def test_transformers5_layout_and_qwen2_bias() -> None:
    """rope_parameters (transformers 5) is read; Qwen2 has q/k/v biases and no o_proj bias."""
    arch = LlamaArchConfig.from_hf(
        {
            **BASE,
            "model_type": "qwen2",
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        }
    )
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, None)
    assert (arch.qkv_bias, arch.o_bias) == (True, False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE type 'yarn'"),
    ],
)
def test_unsupported_configs_are_rejected(override: dict[str, object], message: str) -> None:
    """Architectures and RoPE types blockserve cannot run raise UnsupportedModelError."""
    with pytest.raises(UnsupportedModelError, match=message):
        LlamaArchConfig.from_hf({**BASE, **override})
