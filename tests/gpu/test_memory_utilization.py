"""On a CUDA device, --gpu-memory-utilization sizes the KV cache as vLLM profiles it: the cache
fills the requested share less the model's peak, the engine stays within the share, and its
tokens are those of an engine sized by a block count."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.gpu.test_cuda_graphs import generate

SHARE = 0.2
SLACK = 256 << 20  # cuBLAS's workspace and the allocator's rounding, outside the profile


def test_the_cache_fills_the_share_the_model_leaves(tiny_llama_dir: Path) -> None:
    from blockserve import LLM
    from blockserve.runner.kv_cache import bytes_per_block

    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    kwargs = dict(dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=256)
    llm = LLM(str(tiny_llama_dir), gpu_memory_utilization=SHARE, enforce_eager=True, **kwargs)
    runner = llm.engine.core.runner
    kv_bytes = runner.num_blocks * bytes_per_block(runner.arch, 16, torch.float32)
    assert SHARE * total - (1 << 30) < kv_bytes <= SHARE * total
    sized = generate(llm)
    assert torch.cuda.memory_reserved() <= SHARE * total + SLACK
    llm.shutdown()
    del llm, runner
    torch.cuda.empty_cache()
    fixed = LLM(str(tiny_llama_dir), num_gpu_blocks_override=512, enforce_eager=True, **kwargs)
    assert generate(fixed) == sized
    fixed.shutdown()
