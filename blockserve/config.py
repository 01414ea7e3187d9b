"""Configuration: small frozen dataclasses, validated on construction.

A config's constructor checks types and ranges only; it never touches disk or network.
CLI flags map onto these fields under vLLM's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.core.eviction import EVICTION_POLICIES
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
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise InvalidConfigError(
                f"unknown eviction policy {self.eviction_policy!r}; "
                f"choose one of {', '.join(EVICTION_POLICIES)}"
            )
        get_hash_fn(self.prefix_caching_hash_algo)
        _require_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, True)
        _require_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, True)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise InvalidConfigError(
                "num_gpu_blocks_override must be >= 2 (block 0 is the null block)"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run, and how.

    `model` is a Hugging Face directory or a .gguf file; None means the embedded default model.
    `max_model_len` None means the model's own context length. `device` "auto" is CUDA when
    a device is present, else the CPU (resolved by the runner, not here).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise InvalidConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        _require_positive_int("max_model_len", self.max_model_len, True)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs`
    running requests; a prompt longer than the budget is prefilled in chunks.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive_int("max_model_len", self.max_model_len)
        if self.policy not in SCHEDULING_POLICIES:
            raise InvalidConfigError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front end. `api_key` None leaves /v1/* open."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidConfigError(f"port must be in 0..65535, got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise InvalidConfigError("api_key must be a non-empty string")
