"""Tiny random Llama-family models saved as real Hugging Face directories, for tests.

They go through the real loading path (config.json + safetensors + tokenizer files), and
transformers' own forward is the reference they are compared with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? paris is the capital of france.",
    "blockserve caches prefix blocks by hash; hello world, hello blocks",
] * 20


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (reversible on any text) with an <eos> token."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        TRAINING_TEXT,
        vocab_size=320,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<eos>"],
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides: object) -> Path:
    """Write a tiny random `kind` ("llama" or "qwen2") model with its tokenizer to `path`."""
    tokenizer = make_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = HFQwen2(Qwen2Config(**common))
        with torch.no_grad():  # random biases, so a wrong bias path cannot hide
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(kind)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
