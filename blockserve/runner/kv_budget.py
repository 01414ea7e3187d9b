"""How much memory the KV cache gets, as vLLM decides it: a block count or a byte count when
given, VLLM_CPU_KVCACHE_SPACE on a CPU, else --gpu-memory-utilization's share of the device's
memory (of the host's on a CPU, when given) less what the model takes at its peak."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from blockserve.config import CacheConfig
from blockserve.errors import InvalidConfigError
from blockserve.platform import Memory, host_memory
from blockserve.runner.dummy_steps import profile_run
from blockserve.runner.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    allocate_kv_caches,
    bytes_per_block,
    num_blocks_for,
)
from blockserve.runner.model_runner import RunnerParts

GIB = 1 << 30

logger = logging.getLogger(__name__)
CUDA_UTILIZATION = 0.9  # vLLM's default share of a device


class LargestStep(NamedTuple):
    """The largest step the scheduler may send: what the memory profile runs."""

    tokens: int = 2048
    seqs: int = 64


def fixed_kv_bytes(
    cache_config: CacheConfig, device_type: str, environ: Mapping[str, str]
) -> int | None:
    """The bytes the flags (or VLLM_CPU_KVCACHE_SPACE, GiB, on a CPU) fix before the model
    loads; None when --gpu-memory-utilization sizes the cache after (the default on CUDA)."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    if device_type == "cpu":
        space = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if space:
            if not space.isdigit():
                raise InvalidConfigError(
                    f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got {space!r}"
                )
            if int(space) > 0:  # 0: unset, as vLLM reads it
                return int(space) * GIB
        if cache_config.gpu_memory_utilization is None:
            return DEFAULT_CPU_KV_CACHE_BYTES
    return None


def utilization(cache_config: CacheConfig) -> float:
    return cache_config.gpu_memory_utilization or CUDA_UTILIZATION


def requested_bytes(share: float, memory: Memory, where: str) -> int:
    """`share` of the total; refused when less than that is free now (vLLM's check)."""
    requested = math.ceil(memory.total * share)
    if memory.free < requested:
        raise InvalidConfigError(
            f"free memory on {where} ({_gib(memory.free)}/{_gib(memory.total)} GiB) is less "
            f"than --gpu-memory-utilization {share:g} asks for ({_gib(requested)} GiB): lower "
            "it, or free the memory other processes hold"
        )
    return requested


def kv_bytes_left(requested: int, taken: int, where: str) -> int:
    """What the requested share leaves the KV cache once `taken` (the model's peak) is out."""
    left = requested - taken
    if left <= 0:
        raise InvalidConfigError(
            f"the model takes {_gib(taken)} GiB on {where} at its peak, more than the "
            f"{_gib(requested)} GiB --gpu-memory-utilization grants: raise it"
        )
    return left


def resident_bytes(status: Path = Path("/proc/self/status")) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def host_kv_bytes(share: float, memory: Memory, resident: int) -> int:
    """vLLM's CPU sizing: `share` of the host's memory less this process's resident memory
    (the model loaded)."""
    requested = requested_bytes(share, memory, "the host")
    return kv_bytes_left(requested, resident, "the host")


def cuda_kv_bytes(
    device: torch.device, share: float, before: Memory, profile: Callable[[], None], scratch: int
) -> int:
    """vLLM's profile: `before` is the device's memory before the weights loaded; `profile`
    runs the largest step over a scratch KV cache of `scratch` bytes. The cache gets the
    requested share less the peak the model allocated (weights and activations) and what the
    process took outside torch's allocator meanwhile (library workspaces)."""
    requested = requested_bytes(share, before, str(device))
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch
    free_after, _ = torch.cuda.mem_get_info(device)
    outside_torch = max(0, before.free - free_after - torch.cuda.memory_reserved(device))
    return kv_bytes_left(requested, peak + outside_torch, str(device))


def profile_lengths(largest: LargestStep, max_positions: int) -> list[int]:
    """The largest step as prefills from position 0: --max-num-seqs of them sharing
    --max-num-batched-tokens (more when one would pass the model's positions)."""
    seqs = max(min(largest.seqs, largest.tokens), -(-largest.tokens // max_positions))
    base, extra = divmod(largest.tokens, seqs)
    return [base + (index < extra) for index in range(seqs)]


def scratch_blocks(lengths: list[int], block_size: int) -> int:
    """The null block and each profiled sequence's own blocks."""
    return 1 + sum(-(-length // block_size) for length in lengths)


def full_house_blocks(largest: LargestStep, context: int, block_size: int) -> int:
    """The most blocks the engine can ever hold at once: --max-num-seqs sequences of the whole
    context each, and the null block."""
    return largest.seqs * -(-context // block_size) + 1


def size_from_memory(
    parts: RunnerParts,
    cache_config: CacheConfig,
    lengths: list[int],
    before: Memory | None,
    full_house: int,
) -> None:
    """Give `parts` (assembled over a scratch cache of `scratch_blocks`) the cache the memory
    leaves, before a runner is built over them: on CUDA after profiling `lengths` (`before`:
    the device before the weights), as vLLM sizes it; on a CPU after the weights loaded, and
    no more than `full_house` blocks (a share of the host's memory is the host's, not the
    device's: vLLM-CPU's reading of the flag would take gigabytes a small context never
    uses)."""
    share = utilization(cache_config)
    arch, dtype, device = parts.arch, parts.kv_caches[0].dtype, parts.device
    if before is not None:
        scratch = sum(cache.nbytes for cache in parts.kv_caches)
        nbytes = cuda_kv_bytes(device, share, before, lambda: profile_run(parts, lengths), scratch)
    else:
        nbytes = host_kv_bytes(share, host_memory(), resident_bytes())
    parts.kv_caches = []  # the scratch cache goes before the cache is allocated
    if device.type == "cuda":
        torch.cuda.empty_cache()
    allowed = num_blocks_for(arch, parts.block_size, dtype, None, nbytes)
    num_blocks = allowed if before is not None else min(allowed, full_house)
    parts.kv_caches = allocate_kv_caches(arch, num_blocks, parts.block_size, dtype, device)
    parts.num_blocks = num_blocks
    per_block = bytes_per_block(arch, parts.block_size, dtype)
    where = "the host" if before is None else str(device)
    logger.info(
        "KV cache: %.2f GiB (%d blocks) of the %.2f GiB --gpu-memory-utilization %g allows on %s%s",
        num_blocks * per_block / GIB,
        num_blocks,
        nbytes / GIB,
        share,
        where,
        ": all that the running sequences can hold" if num_blocks < allowed else "",
    )


def cuda_memory(device: torch.device) -> Memory:
    free, total = torch.cuda.mem_get_info(device)
    return Memory(free=free, total=total)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"
