"""KV cache tensors: how many blocks fit a budget, and their allocation. Layout per layer
(attention/metadata.py): [2, num_blocks, block_size, num_kv_heads, head_dim]. On a CPU the
caches are one anonymous mapping, zero without a write, each page mapped in when first written
(or ahead of the steps, by page_mapping.py), so start-up never writes the whole cache."""

from __future__ import annotations

import math
import mmap

import torch

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB


def bytes_per_block(arch: LlamaArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * element_size


def num_blocks_for(
    arch: LlamaArchConfig,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int | None,
    memory_bytes: int | None,
) -> int:
    """The block count: `num_blocks` if given, else as many as `memory_bytes` holds
    (default 2 GiB). Block 0 is the null block, so at least 2 are needed."""
    if num_blocks is None:
        budget = memory_bytes if memory_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // bytes_per_block(arch, block_size, dtype)
    if num_blocks < 2:
        raise InvalidConfigError(
            f"the KV cache budget holds {num_blocks} blocks; at least 2 are needed "
            f"({bytes_per_block(arch, block_size, dtype)} bytes each)"
        )
    return num_blocks


def allocate_kv_caches(
    arch: LlamaArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer."""
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
    return list(zeroed_on_demand((arch.num_layers, *shape), dtype).unbind(0))


def zeroed_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor over an anonymous mapping: nothing is written (or committed) until
    a page is first touched. The tensor keeps the mapping alive; it is unmapped with it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)
