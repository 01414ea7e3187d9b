"""Reading Llama-family configs, RoPE with llama3 scaling, and model-level equivalence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockserve.errors import UnsupportedModelError
from blockserve.model.arch import LlamaArchConfig, RopeScaling
from blockserve.model.llama import rope_inv_freq
from tests.runner.test_model_runner import greedy_generate, make_runner
from tests.tiny_models import save_tiny_model

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


def test_llama3_inv_freq_matches_transformers() -> None:
    """llama3 frequency scaling equals transformers' implementation."""
    config = LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=LLAMA3_ROPE
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = rope_inv_freq(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 32))
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)


def test_llama3_model_generates_like_transformers(tmp_path: Path) -> None:
    """A tiny Llama with llama3 RoPE scaling, tied embeddings and MHA: greedy output equals HF."""
    model_dir = save_tiny_model(
        tmp_path / "m",
        "llama",
        seed=3,
        rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=True,
        num_key_value_heads=4,
    )
    prompt = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = greedy_generate(make_runner(model_dir), [prompt], 16)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = hf.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
    )[0, 45:].tolist()
    assert ours == reference
