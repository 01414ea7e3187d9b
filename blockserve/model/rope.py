"""Rotary position embeddings: the inverse frequencies (with llama3-style scaling), the cos/sin
tables every layer of a step shares, and the rotation of q and k by them."""

from __future__ import annotations

import math

import torch
from torch import nn

from blockserve.model.arch import RopeScaling

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim / 2] each


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with llama3-style scaling when configured.

    llama3: wavelengths longer than original_max / low_freq_factor are slowed by `factor`,
    shorter than original_max / high_freq_factor are kept, and those between are blended.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's absolute position, looked up once per step for every layer.

    The tables are float32 (exact at long contexts); the rotation itself runs in the model's
    dtype, as the reference implementation does.
    """

    cos_cache: torch.Tensor  # [max_positions, head_dim / 2] float32
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_pos, dim / 2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, dim / 2]
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate halves: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin). x: [tokens, heads, dim]."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
