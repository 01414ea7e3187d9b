"""How our CPU kernels split their work across threads (csrc/cpu/tasks.h: each thread starts
on its own run of tasks and takes the others' from their backs once its run is done). Every
task runs exactly once, whoever runs it: the results are the same bits on 1, 2 and 3 threads
(3 on a 2-core host makes the threads take each other's tasks), and an operator that adds in
place adds each row once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from blockserve.kernels import CpuKernels
from tests.kernels.test_cpu_kernel import AMX, DTYPES

THREADS = (1, 2, 3)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def on_each_thread_count(run: Callable[[], Any]) -> list[Any]:
    """run() once per count in THREADS, from fresh inputs each time."""
    results = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        results.append(run())
    return results


def same_bits(results: list[Any]) -> bool:
    first = results[0]
    return all(
        all(torch.equal(a, b) for a, b in zip(first, other, strict=True)) for other in results[1:]
    )


def randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_is_the_same_on_any_thread_count(
    kernels: CpuKernels, dtype: torch.dtype, restore_threads: None
) -> None:
    """A causal prefill's row blocks cost more the later they lie (and are taken last first)."""
    kernel = kernels.dense_attention(torch.zeros(1, 64, dtype=dtype))
    assert kernel is not None
    query_len, kv_heads, group = 100, 3, 3
    q = randn(1, kv_heads, group * query_len, 64, seed=1, dtype=dtype)
    k, v = (randn(1, kv_heads, query_len, 64, seed=s, dtype=dtype) for s in (2, 3))
    counts = torch.arange(1, query_len + 1).repeat(group).unsqueeze(0)
    results = on_each_thread_count(lambda: kernel(q, k, v, counts, 0.125))
    assert results[0][0].shape == (1, kv_heads, group * query_len, 64)
    assert same_bits(results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_is_the_same_on_any_thread_count(
    kernels: CpuKernels, dtype: torch.dtype, restore_threads: None
) -> None:
    ops = kernels.loader.ops(dtype)
    seqs, kv_heads, group, blocks = 7, 3, 3, 6
    k_cache, v_cache = (randn(seqs * blocks, 16, kv_heads, 64, seed=s, dtype=dtype) for s in (4, 5))
    q = randn(seqs, kv_heads * group, 64, seed=6, dtype=dtype)
    tables = torch.randperm(seqs * blocks, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([1, 96, 17, 50, 64, 33, 80])
    results = on_each_thread_count(
        lambda: ops.paged_decode(q, k_cache, v_cache, tables.view(seqs, blocks), lengths, 0.125)
    )
    assert same_bits(results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_split_into_key_ranges_is_the_same_on_any_thread_count(
    kernels: CpuKernels, dtype: torch.dtype, restore_threads: None
) -> None:
    """One sequence of 1,000 keys: its 3 (sequence, KV head) tasks split into 3 ranges each,
    by the shapes alone, so the merge adds the same partials in the same order."""
    ops = kernels.loader.ops(dtype)
    kv_heads, group, blocks = 3, 3, 63
    k_cache, v_cache = (randn(blocks, 16, kv_heads, 64, seed=s, dtype=dtype) for s in (11, 12))
    q = randn(1, kv_heads * group, 64, seed=13, dtype=dtype)
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(14)).view(1, blocks)
    results = on_each_thread_count(
        lambda: ops.paged_decode(q, k_cache, v_cache, tables, torch.tensor([1000]), 0.125)
    )
    assert same_bits(results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_each_row_once_on_any_thread_count(
    kernels: CpuKernels, dtype: torch.dtype, restore_threads: None
) -> None:
    """300 rows of 576 are six runs of 56 rows (32,768 elements a run) and one of 20."""
    ops = kernels.layer_ops(torch.zeros(1, 576, dtype=dtype), head_dim=64)
    assert ops is not None
    update, weight = randn(300, 576, seed=8, dtype=dtype), randn(576, seed=9, dtype=dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        residual = randn(300, 576, seed=10, dtype=dtype)
        normed = ops.add_rms_norm(residual, update, weight, 1e-5)
        return residual, normed

    results = on_each_thread_count(run)
    expected = (randn(300, 576, seed=10, dtype=dtype).float() + update.float()).to(dtype)
    assert torch.equal(results[0][0], expected)  # each row's update added once
    assert same_bits(results)


@pytest.mark.skipif(not AMX, reason="needs an x86 CPU with AMX-BF16 (the tile products)")
def test_tile_linear_is_the_same_on_any_thread_count(
    kernels: CpuKernels, restore_threads: None
) -> None:
    """18 tasks of 32 columns each, every output column written by exactly one."""
    ops = kernels.loader.ops(torch.bfloat16)
    weight = randn(576, 576, seed=11, dtype=torch.bfloat16)
    x = randn(5, 576, seed=12, dtype=torch.bfloat16)
    packed = ops.tile_pack(weight)
    results = on_each_thread_count(lambda: (ops.tile_linear(x, packed, None),))
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert (results[0][0].float() - expected.float()).abs().max().item() <= (
        expected.float().abs().max().item() * 2**-7
    )
    assert same_bits(results)
