"""On a CUDA device: the triton and cuda backends equal the torch backend (bf16 and fp16),
and greedy generation with each equals the torch backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockserve.attention.torch_backend import TorchAttentionBackend
from tests.attention.cases import make_case

MIXED = [(0, 23), (37, 1), (16, 9), (100, 1), (5, 130), (1000, 1), (64, 1), (300, 17)]
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def backend(name: str):  # type: ignore[no-untyped-def]
    if name == "triton":
        from blockserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from blockserve.attention.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend()


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 64), (32, 8, 128)])
def test_backend_matches_torch(
    name: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Mixed batches on the device: each backend's output equals the torch backend's."""
    case = make_case(MIXED, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=1).to("cuda")
    reference_cache = case.kv_cache.clone()
    under_test = backend(name)
    out = under_test.forward(
        case.query, case.key, case.value, case.kv_cache, under_test.prepare(case.metadata)
    )
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(
        case.query, case.key, case.value, reference_cache, torch_backend.prepare(case.metadata)
    )
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert (out.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]
    assert torch.equal(case.kv_cache, reference_cache)


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_greedy_generation_matches_torch_backend(name: str, tiny_llama_dir: Path) -> None:
    """A tiny model generates the same greedy tokens with each backend (float32)."""
    from blockserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (7, 33, 70)]
    outputs = {}
    for backend_name in ("torch", name):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            attention_backend=backend_name,
            num_gpu_blocks_override=256,
        )
        outputs[backend_name] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outputs[name] == outputs["torch"]
