"""Configuration: small frozen dataclasses, validated on construction.

A config's constructor checks types and ranges only; it never touches disk or network.
CLI flags map onto these fields under vLLM's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.core.hashing import get_hash_fn
from blockserve.errors import InvalidConfigError


def _require_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache and its prefix cache.

    The cache is sized by `num_gpu_blocks_override` (a block count) or, failing that, by
    `kv_cache_memory_bytes`; with neither, the runner picks a default budget.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        get_hash_fn(self.prefix_caching_hash_algo)
        _require_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, True)
        _require_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, True)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise InvalidConfigError(
                "num_gpu_blocks_override must be >= 2 (block 0 is the null block)"
            )
