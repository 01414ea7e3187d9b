"""CacheConfig validates on construction and touches nothing else."""

from __future__ import annotations

import pytest

from blockserve.config import CacheConfig
from blockserve.errors import InvalidConfigError, UnknownHashAlgorithmError


def test_defaults_match_reference() -> None:
    """Block size 16, prefix caching on, sha256, no explicit size."""
    config = CacheConfig()
    assert (config.block_size, config.enable_prefix_caching) == (16, True)
    assert config.prefix_caching_hash_algo == "sha256"
    assert (config.num_gpu_blocks_override, config.kv_cache_memory_bytes) == (None, None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": 16.0},
        {"num_gpu_blocks_override": 1},
        {"num_gpu_blocks_override": -3},
        {"kv_cache_memory_bytes": 0},
    ],
)
def test_bad_values_raise(kwargs: dict[str, object]) -> None:
    """Out-of-range or mistyped sizes raise InvalidConfigError."""
    with pytest.raises(InvalidConfigError):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_hash_algo_raises() -> None:
    """An unknown hash algorithm is a typed config error."""
    with pytest.raises(UnknownHashAlgorithmError, match="md5"):
        CacheConfig(prefix_caching_hash_algo="md5")
