"""A SmolVLM checkpoint built at test time (no hub here, and no package ships a VLM): the text
half is the real SmolLM2-135M-Instruct the project installs, its vocabulary grown by SmolVLM's
image tokens; the vision half a seeded random SigLIP. Saved as transformers saves a
SmolVLMForConditionalGeneration, with the tokenizer, chat template and image processor."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer
from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration
from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

from blockserve.model.loader import resolve_model_dir
from tests.hub_cache import add_snapshot

# SmolVLM's added tokens, in its order after the base vocabulary.
IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
# A vision half small enough for a unit test: 2 x 2 patches of 8 pixels a token, 4 tokens a tile.
TINY_VISION: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "patch_size": 8,
    "image_size": 32,
}
TINY_SCALE_FACTOR = 2
TINY_TILE = 32


def save_test_smolvlm(
    directory: Path, vision: dict[str, Any] = TINY_VISION, scale: int = 2
) -> Path:
    base = resolve_model_dir(None)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE)
    vocab = tokenizer.get_vocab_size()
    text = json.loads((base / "config.json").read_text())
    text_config = LlamaConfig(**{**text, "vocab_size": vocab})
    config = SmolVLMConfig(
        text_config=text_config.to_dict(),
        vision_config=vision,
        scale_factor=scale,
        image_token_id=tokenizer.token_to_id("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = SmolVLMForConditionalGeneration(config).eval()
    weights = load_file(str(base / "model.safetensors"))
    state = model.model.text_model.state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            target = state[name.removeprefix("model.")]
            target[: tensor.shape[0]].copy_(tensor)  # the embeddings' new rows stay random
    model.save_pretrained(directory)
    tile = vision["image_size"]
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "SmolVLMImageProcessor",
                "size": {"longest_edge": 4 * tile},
                "max_image_size": {"longest_edge": tile},
                "do_image_splitting": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "rescale_factor": 1 / 255,
                "resample": 1,
            },
            indent=2,
        )
    )
    tokens_per_tile = (tile // vision["patch_size"]) ** 2 // scale**2
    processor = {"image_seq_len": tokens_per_tile, "processor_class": "SmolVLMProcessor"}
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    for extra in ("generation_config.json",):
        if (base / extra).is_file():
            shutil.copy2(base / extra, directory / extra)
    return directory


HUB_ID = "HuggingFaceTB/SmolVLM-256M-Instruct"
HUB_COMMIT = "5" * 40


def save_test_smolvlm_hub(root: Path) -> Path:
    """The test checkpoint cached as huggingface_hub caches HUB_ID at main: the cache's path
    (for `download_dir`, or HF_HUB_CACHE)."""
    cache = root / "cache"
    add_snapshot(cache, HUB_ID, HUB_COMMIT, save_test_smolvlm(root / "model"), ("main",))
    return cache


if __name__ == "__main__":
    print(save_test_smolvlm_hub(Path(sys.argv[1])))
