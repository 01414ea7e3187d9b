"""KV cache sizing and allocation: blocks from a byte budget, the null-block minimum, shapes."""

from __future__ import annotations

import pytest
import torch

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig
from blockserve.runner.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for
from tests.model.test_arch import BASE

# 2 layers, 2 KV heads of 16: one 16-token block is 2 * 2 * 16 * 2 * 16 elements.
ARCH = LlamaArchConfig.from_hf({**BASE, "num_key_value_heads": 2})


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    """2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes (float32) = 8,192 bytes."""
    assert bytes_per_block(ARCH, 16, torch.float32) == 8192
    assert bytes_per_block(ARCH, 16, torch.bfloat16) == 4096


def test_block_count_from_override_or_budget() -> None:
    """An explicit count wins; otherwise the budget is divided by the block size in bytes."""
    assert num_blocks_for(ARCH, 16, torch.float32, 7, None) == 7
    assert num_blocks_for(ARCH, 16, torch.float32, None, 8192 * 10 + 100) == 10
    assert num_blocks_for(ARCH, 16, torch.float32, None, None) == (2 << 30) // 8192


def test_a_budget_below_two_blocks_is_refused() -> None:
    """Block 0 is the null block: fewer than 2 blocks cannot hold anything."""
    with pytest.raises(InvalidConfigError, match="holds 1 blocks; at least 2"):
        num_blocks_for(ARCH, 16, torch.float32, None, 8192)


def test_one_zeroed_tensor_per_layer() -> None:
    """Per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    caches = allocate_kv_caches(ARCH, 5, 16, torch.float32, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, 16, 2, 16)] * 2
    assert all(not c.any() for c in caches)
