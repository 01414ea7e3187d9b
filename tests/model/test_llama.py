"""The Llama-family model: llama3 RoPE frequencies and whole-model greedy output equal to
transformers' (tied embeddings, MHA)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from blockserve.model.arch import RopeScaling
from blockserve.model.rope import rope_inv_freq
from tests.model.test_arch import BASE, LLAMA3_ROPE
from tests.runner.test_model_runner import greedy_generate, make_runner
from tests.tiny_models import save_tiny_model


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
