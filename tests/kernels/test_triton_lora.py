"""LoRA's fused Triton kernel (kernels/triton_lora.py), under the interpreter on a CPU and
compiled on a CUDA device, equals the grouped products in torch: uneven groups, a rank below
the slot's width, slots out of order, tokens scattered through the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockserve.kernels.triton_lora import add_lora

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, out, a, b, groups):  # type: ignore[no-untyped-def]
    expected = out.clone()
    for slot, rows in groups:
        expected[rows] += (x[rows] @ a[slot]) @ b[slot]
    return expected


@pytest.mark.parametrize(("in_features", "out_features", "ranks"), [(64, 96, 48), (40, 200, 16)])
def test_the_kernel_equals_the_grouped_products(
    in_features: int, out_features: int, ranks: int
) -> None:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE)

    x, out = rand(37, in_features), rand(37, out_features)
    a, b = rand(4, in_features, ranks), rand(4, ranks, out_features)
    a[2, :, ranks - 8 :] = 0  # slot 2 holds a smaller rank: its last columns are zero
    b[2, ranks - 8 :] = 0
    order = torch.randperm(37, generator=generator).to(DEVICE)
    groups = [(3, order[:20]), (0, order[20:23]), (2, order[23:30])]  # token 30.. base model
    src = torch.cat([rows for _, rows in groups])
    starts = torch.tensor([0, 20, 23, 30], device=DEVICE)
    slots = torch.tensor([slot for slot, _ in groups], device=DEVICE)
    expected = reference(x, out, a, b, groups)
    got = add_lora(x, out.clone(), a, b, src, starts, slots, max_width=20)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_an_engine_through_the_kernel_gives_the_bmm_tokens(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Base, two adapters and the same prompt under each, as tests/lora runs them: the
    kernel in place of the two bmm gives the same greedy tokens (float32). Each engine's
    products are chosen when it is built, as on CUDA, on any device."""
    pytest.importorskip("peft", reason="the adapters are made with peft (a dev extra)")
    from blockserve import LLM, LoRARequest, SamplingParams
    from blockserve.lora import manager
    from blockserve.lora.layers import TORCH_PRODUCTS, TritonProducts
    from tests.lora.adapters import save_adapter

    base, root = tiny_llama_dir, tmp_path
    loras = [None] + [
        LoRARequest(name, i + 1, str(save_adapter(base, root / name, seed=i + 1, rank=4 + 4 * i)))
        for i, name in enumerate(("one", "two"))
    ]
    prompts = [{"prompt_token_ids": list(range(10, 40))}] * 3
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = []
    for products in (TORCH_PRODUCTS, TritonProducts(add_lora)):
        monkeypatch.setattr(manager, "lora_products", lambda device, kernels, p=products: p)
        llm = LLM(
            str(base),
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            num_gpu_blocks_override=64,
            device=DEVICE,
        )
        results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1] != outputs[0][2]
