"""The KV cache's budget: the flags' precedence, VLLM_CPU_KVCACHE_SPACE, and
--gpu-memory-utilization's share of the host (vLLM's CPU arithmetic) on a runner resized after
its model loaded, whose tokens stay those of a runner sized by a block count."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from blockserve.config import CacheConfig, ModelConfig
from blockserve.errors import InvalidConfigError
from blockserve.runner import kv_budget
from blockserve.runner.build import build_runner
from blockserve.runner.kv_budget import (
    GIB,
    LargestStep,
    Memory,
    fixed_kv_bytes,
    full_house_blocks,
    host_kv_bytes,
    host_memory,
    profile_lengths,
    resident_bytes,
    scratch_blocks,
)
from blockserve.runner.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES, bytes_per_block
from tests.runner.test_model_runner import greedy_generate


@pytest.mark.parametrize(
    ("cache", "device", "environ", "expected"),
    [
        (CacheConfig(), "cpu", {}, DEFAULT_CPU_KV_CACHE_BYTES),
        (CacheConfig(kv_cache_memory_bytes=5), "cpu", {"VLLM_CPU_KVCACHE_SPACE": "3"}, 5),
        (CacheConfig(kv_cache_memory_bytes=5), "cuda", {}, 5),
        (CacheConfig(), "cpu", {"VLLM_CPU_KVCACHE_SPACE": "3"}, 3 * GIB),
        (CacheConfig(), "cpu", {"VLLM_CPU_KVCACHE_SPACE": "0"}, DEFAULT_CPU_KV_CACHE_BYTES),
        (CacheConfig(), "cpu", {"VLLM_CPU_KVCACHE_SPACE": ""}, DEFAULT_CPU_KV_CACHE_BYTES),
        (CacheConfig(gpu_memory_utilization=0.5), "cpu", {}, None),
        (CacheConfig(gpu_memory_utilization=0.5), "cpu", {"VLLM_CPU_KVCACHE_SPACE": "3"}, 3 * GIB),
        (CacheConfig(), "cuda", {"VLLM_CPU_KVCACHE_SPACE": "3"}, None),
    ],
)
def test_what_fixes_the_budget_before_the_model_loads(
    cache: CacheConfig, device: str, environ: dict[str, str], expected: int | None
) -> None:
    assert fixed_kv_bytes(cache, device, environ) == expected


def test_a_kvcache_space_that_is_not_gib_is_refused() -> None:
    with pytest.raises(InvalidConfigError) as error:
        fixed_kv_bytes(CacheConfig(), "cpu", {"VLLM_CPU_KVCACHE_SPACE": "2.5"})
    assert str(error.value) == "VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got '2.5'"


def test_host_share_less_the_resident_memory() -> None:
    memory = Memory(free=12 * GIB, total=16 * GIB)
    assert host_kv_bytes(0.5, memory, resident=GIB) == 7 * GIB
    with pytest.raises(InvalidConfigError) as error:
        host_kv_bytes(0.9, memory, resident=GIB)
    assert str(error.value) == (
        "free memory on the host (12.00/16.00 GiB) is less than --gpu-memory-utilization 0.9 "
        "asks for (14.40 GiB): lower it, or free the memory other processes hold"
    )
    with pytest.raises(InvalidConfigError) as error:
        host_kv_bytes(0.25, memory, resident=5 * GIB)
    assert str(error.value) == (
        "the model takes 5.00 GiB on the host at its peak, more than the 4.00 GiB "
        "--gpu-memory-utilization grants: raise it"
    )


def test_proc_files_are_read(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    600 kB\n")
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t  250 kB\nThreads:\t3\n")
    assert host_memory(meminfo) == Memory(free=600 * 1024, total=1000 * 1024)
    assert resident_bytes(status) == 250 * 1024
    assert resident_bytes() > 0  # this process's own


@pytest.mark.parametrize(
    ("largest", "max_positions", "lengths"),
    [
        (LargestStep(2048, 64), 8192, [32] * 64),
        (LargestStep(10, 64), 8192, [1] * 10),
        (LargestStep(100, 3), 8192, [34, 33, 33]),
        (LargestStep(20000, 1), 8192, [6667, 6667, 6666]),
    ],
)
def test_the_profiled_step(largest: LargestStep, max_positions: int, lengths: list[int]) -> None:
    assert profile_lengths(largest, max_positions) == lengths
    assert sum(lengths) == largest.tokens


def test_scratch_blocks_hold_each_sequence_and_the_null_block() -> None:
    assert scratch_blocks([32] * 4, 16) == 9
    assert scratch_blocks([34, 33, 33], 16) == 10


def test_a_runner_sized_by_the_host_share(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Half the host's memory less the resident GiB, but never more blocks than 64 sequences
    of the model's 512 positions hold (2,049 with the null block): the log says both."""
    monkeypatch.setattr(kv_budget, "host_memory", lambda: Memory(free=4 * GIB, total=4 * GIB))
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: GIB)
    model = ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu")
    with caplog.at_level(logging.INFO, logger="blockserve.runner.kv_budget"):
        sized = build_runner(model, CacheConfig(gpu_memory_utilization=0.5))
    per_block = bytes_per_block(sized.arch, 16, sized.kv_caches[0].dtype)
    assert (per_block, GIB // per_block) == (8192, 131072)  # what the share alone allows
    assert sized.num_blocks == full_house_blocks(LargestStep(), 512, 16) == 64 * 32 + 1
    assert sized.kv_caches[0].shape[1] == sized.num_blocks
    assert caplog.messages[-1] == (
        "KV cache: 0.02 GiB (2049 blocks) of the 1.00 GiB --gpu-memory-utilization 0.5 allows "
        "on the host: all that the running sequences can hold"
    )
    fixed = build_runner(model, CacheConfig(num_gpu_blocks_override=64))
    prompts = [list(range(3, 40)), list(range(7, 12))]
    assert greedy_generate(sized, prompts, 8) == greedy_generate(fixed, prompts, 8)


def test_a_share_smaller_than_the_full_house_is_what_the_cache_gets(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = 2 * (GIB + 1000 * 8192)  # half of it: the resident GiB and 1,000 blocks
    monkeypatch.setattr(kv_budget, "host_memory", lambda: Memory(free=total, total=total))
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: GIB)
    model = ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu")
    assert build_runner(model, CacheConfig(gpu_memory_utilization=0.5)).num_blocks == 1000
