"""KV cache sizing and allocation: blocks from a byte budget, the null-block minimum, shapes."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig
from blockserve.runner.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    num_blocks_for,
)
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


def test_layers_are_separate_tensors_of_one_mapping() -> None:
    """A write into one layer's cache leaves every other layer's as it was (zero)."""
    caches = allocate_kv_caches(ARCH, 5, 16, torch.float32, torch.device("cpu"))
    caches[0][1, 4].fill_(3.0)
    assert caches[0][1, 4].eq(3.0).all() and caches[0].count_nonzero().item() == 16 * 2 * 16
    assert not caches[1].any()


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(pages of `tensor`'s memory that are mapped in, pages in all), by mincore(2)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // mmap.PAGESIZE)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw), pages


def test_allocating_maps_no_page_until_one_is_written() -> None:
    """The caches commit no memory when allocated; a write maps in its own page alone. (Under
    2 MiB in all, so that no huge page can back it, whatever the host's THP setting.)"""
    arch = LlamaArchConfig.from_hf({**BASE, "num_key_value_heads": 4, "num_hidden_layers": 3})
    caches = allocate_kv_caches(arch, 40, 16, torch.float32, torch.device("cpu"))
    assert [resident_pages(cache) for cache in caches] == [(0, 80)] * 3  # 2 x 40 blocks of 4 KiB
    caches[1][1, 30].fill_(1.5)  # one block of layer 1's V: one page
    assert [resident_pages(cache) for cache in caches] == [(0, 80), (1, 80), (0, 80)]
    assert [cache.count_nonzero().item() for cache in caches] == [0, 16 * 4 * 16, 0]
