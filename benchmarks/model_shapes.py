"""Models of the sizes people deploy, for the races, built at random where no hub is reachable:
Llama-3.2-1B's shape (16 layers of width 2,048, 32 query and 8 KV heads of 64, an MLP of
8,192, tied embeddings, rope theta 500,000) with the embedded SmolLM2 tokenizer's vocabulary of
49,152 (so both engines can detokenize what it writes), seeded, saved once in bf16 as a Hugging
Face directory under the cache dir. What it computes is noise; what it costs is a 1B model's.

    .venv/bin/python benchmarks/model_shapes.py llama-3.2-1b-shape   # prints its directory
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

LLAMA_1B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
SHAPES = {"llama-3.2-1b-shape": LLAMA_1B_SHAPE}


def model_dir(name: str) -> Path:
    """The directory of shape `name`, built the first time (a minute or two on 2 cores)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from blockserve.config import default_cache_dir
    from blockserve.model.loader import resolve_model_dir

    directory = default_cache_dir() / "bench-models" / name
    if (directory / "model.safetensors").is_file():
        return directory
    base = resolve_model_dir(None)
    embedded = json.loads((base / "config.json").read_text())
    config = LlamaConfig(
        **SHAPES[name],
        vocab_size=embedded["vocab_size"],
        rms_norm_eps=1e-5,
        bos_token_id=embedded["bos_token_id"],
        eos_token_id=embedded["eos_token_id"],
        pad_token_id=embedded["pad_token_id"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    scratch = directory.with_name(name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch)
    for file in base.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(file, scratch / file.name)
    shutil.rmtree(directory, ignore_errors=True)
    scratch.rename(directory)
    return directory


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(model_dir(sys.argv[1]))
