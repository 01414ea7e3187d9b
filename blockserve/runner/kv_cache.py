"""KV cache tensors: how many blocks fit a budget, and their allocation. Layout per layer
(attention/metadata.py): [2, num_blocks, block_size, num_kv_heads, head_dim]. On a CPU the
caches are one anonymous mapping, zero without a write, each page mapped in when first written
(or ahead of the steps, by page_mapping.py), so start-up never writes the whole cache."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB

logger = logging.getLogger(__name__)


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


def context_length(
    max_model_len: int | None, arch: LlamaArchConfig, num_blocks: int, block_size: int
) -> int:
    """The model's context, or `max_model_len`, within what the KV cache can hold: a request
    that could never fit would wait forever."""
    capacity = (num_blocks - 1) * block_size
    wanted = max_model_len or arch.max_position_embeddings
    if wanted <= capacity:
        return int(wanted)
    if max_model_len is not None:
        raise InvalidConfigError(
            f"max_model_len {wanted} exceeds the KV cache, which holds {capacity} tokens; "
            "give the cache more memory or lower max_model_len"
        )
    logger.warning("the KV cache holds %d tokens: the context is capped there", capacity)
    return capacity
