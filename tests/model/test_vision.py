"""The SmolVLM vision tower and connector equal transformers' (SmolVLMModel.get_image_features)
on a small random model in SmolVLM's layout, loaded by the checkpoint's tensor names."""

from __future__ import annotations

import torch
from transformers import SmolVLMConfig
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMModel

from blockserve.model.vision import VisionConfig, VisionTower

HF_CONFIG = {
    "scale_factor": 2,
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 4,
        "image_size": 32,
    },
    "text_config": {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
}


def test_image_features_equal_transformers() -> None:
    torch.manual_seed(0)
    reference = SmolVLMModel(SmolVLMConfig(**HF_CONFIG)).eval()
    config = VisionConfig.from_hf(HF_CONFIG)
    assert (config.patches_per_side, config.tokens_per_tile) == (8, 16)
    tower = VisionTower(config)
    wanted = {
        name: tensor
        for name, tensor in reference.state_dict().items()
        if name.startswith(("vision_model.", "connector."))
    }
    assert set(wanted) == set(tower.state_dict())  # every tensor, by the checkpoint's names
    tower.load_state_dict(wanted)
    tiles = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.get_image_features(tiles[None]).pooler_output[0]
    ours = tower(tiles)
    assert ours.shape == (3 * 16, 48)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
