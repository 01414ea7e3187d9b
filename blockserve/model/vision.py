"""The vision half of Idefics3 / SmolVLM: a SigLIP transformer over whole tiles (every tile is
tile x tile, so positions are the patch grid in order, no patch masked) and the connector that
merges scale_factor^2 patches into one text-width token. Module names are the checkpoints'
(`model.vision_model.*`, `model.connector.*`), so their tensors load by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.multimodal.idefics3 import Idefics3Processing


@dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's `vision_config` and the connector's `scale_factor` (SmolVLM-256M's by
    default: SigLIP-base/16 at 512 pixels, 4 x 4 patches to a token)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    patch_size: int = 16
    image_size: int = 512
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    scale_factor: int = 4
    text_hidden_size: int = 576

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> VisionConfig:
        """From a SmolVLM / Idefics3 config.json."""
        vision = config["vision_config"]
        text = config["text_config"]
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            patch_size=vision["patch_size"],
            image_size=vision["image_size"],
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            num_channels=vision.get("num_channels", 3),
            scale_factor=config.get("scale_factor", 2),
            text_hidden_size=text["hidden_size"],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens a tile becomes in the prompt (the processor's image_seq_len)."""
        return self.patches_per_side**2 // self.scale_factor**2


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[: patches.shape[1]]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        width = config.hidden_size
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = hidden.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(hidden).view(tiles, patches, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, width))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hidden), approximate="tanh"))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class VisionTransformer(nn.Module):
    """Tiles [n, 3, image_size, image_size] to patch states [n, patches, hidden_size]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class ModalityProjection(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.scale_factor**2
        self.proj = nn.Linear(merged, config.text_hidden_size, bias=False)


class Connector(nn.Module):
    """Patch states [n, side^2, hidden] to tokens [n, (side / s)^2, text width]: each s x s
    square of patches concatenated (the checkpoints' pixel shuffle), then projected."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = ModalityProjection(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = hidden.shape
        side, s = int(patches**0.5), self.scale_factor
        # [n, rows, cols, w] as [n, square row, row in it, square col, col in it, w]: each
        # square's patches row by row, squares row by row (the order the weights learnt).
        grid = hidden.view(tiles, side // s, s, side // s, s, width)
        merged = grid.permute(0, 1, 3, 2, 4, 5).reshape(tiles, (side // s) ** 2, s * s * width)
        return self.modality_projection.proj(merged)


class VisionTower(nn.Module):
    """Tiles to the text model's input embeddings: [n, 3, H, W] -> [n * tokens_per_tile,
    text width], tile by tile in the order the prompt's image tokens are."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = VisionTransformer(config)
        self.connector = Connector(config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tokens = self.connector(self.vision_model(pixel_values))
        return tokens.reshape(-1, tokens.shape[-1])


@dataclass
class VisionModel:
    """A vision-language checkpoint's image half: the tower, how its images are processed,
    and the token whose positions take the tower's outputs."""

    tower: VisionTower
    processing: Idefics3Processing
    image_token_id: int

    def encode(self, pixel_values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """The tokens of tiles [tiles, 3, tile, tile] (one image's, or several images' one
        after the other): [tiles * tokens_per_tile, text width], each tile's in the order of
        its image tokens in the prompt."""
        device = next(self.tower.parameters()).device
        pixels = torch.from_numpy(pixel_values).to(device=device, dtype=dtype)
        return self.tower(pixels)
