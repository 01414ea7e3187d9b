"""KV cache tensors: how many blocks fit a budget, and their allocation.

Layout per layer (see attention/metadata.py): [2, num_blocks, block_size, num_kv_heads, head_dim].

On a CPU the caches are one anonymous memory mapping, which the OS hands out zeroed, page by
page on first touch, instead of a `torch.zeros` that writes every byte before the engine can
start: on a 2-vCPU VM, zeroing the default 2 GiB was most of the engine's build, the first
touch of each page being dear there (docs/benchmarks.md, "On an AVX2-only host"). Once the
model is loaded, a background thread asks the kernel to map the pages in (`MADV_POPULATE_WRITE`,
Linux 5.14+: it maps, and never changes what a page holds, so it may race the engine's own
writes), the lowest blocks of every layer first, as the block pool hands them out in that
order, so that the first steps do not pay for the faults. It maps a few MiB a call: one call
over the whole mapping held the process's memory-map lock for its duration, and every
allocation of the weights loading beside it waited (the engine's build took 2 s longer). Where
the kernel lacks it, pages are mapped as they are first written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import threading
from collections.abc import Sequence

import torch

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig

logger = logging.getLogger(__name__)

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


MADV_POPULATE_WRITE = 23  # linux/mman.h
POPULATE_BLOCKS_PER_CALL = 256  # 3 MiB of one layer's K (or V) for the default model in float32


def populate_in_background(
    caches: Sequence[torch.Tensor], blocks_per_call: int = POPULATE_BLOCKS_PER_CALL
) -> threading.Thread | None:
    """Map in the pages of CPU KV caches shaped [2, num_blocks, ...], on a daemon thread that
    ends when the kernel has: blocks [0, n) of every layer's K and V, then [n, 2n), and so on
    (each call releases the GIL; the thread holds the tensors, so the mapping outlives it).
    None where there is nothing to map or the C library cannot be reached."""
    name = ctypes.util.find_library("c")
    if name is None or not caches or any(cache.device.type != "cpu" for cache in caches):
        return None
    madvise = ctypes.CDLL(name, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    num_blocks = caches[0].shape[1]

    def populate() -> None:
        for first in range(0, num_blocks, blocks_per_call):
            for cache in caches:
                for part in cache[:, first : first + blocks_per_call]:  # K, then V
                    start = part.data_ptr() // page * page  # madvise takes whole pages
                    end = part.data_ptr() + part.numel() * part.element_size()
                    if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                        logger.debug(
                            "KV cache pages map on first write (madvise: errno %d)",
                            ctypes.get_errno(),
                        )
                        return

    thread = threading.Thread(target=populate, name="blockserve-kv-populate", daemon=True)
    thread.start()
    return thread
