"""On a CUDA device: decode steps replayed from CUDA graphs, and with async scheduling too, give
the eager path's greedy tokens; once the engine is ready no Triton kernel compiles, whatever
the batch and the contexts."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockserve.kernels.triton_compiles import TritonCompiles

# Decodes at several batch sizes (padded to their buckets), prompts of 1 to 300 tokens, so
# that steps launch decode and prefill tiles with several KV split counts.
PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 17, 33, 70, 150, 300, 9, 12, 3, 40)]


def generate(llm: object, max_tokens: int = 24) -> list[list[int]]:
    from blockserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_and_async_scheduling_give_the_eager_tokens(
    tiny_llama_dir: Path, dtype: str
) -> None:
    from blockserve import LLM

    outputs = {}
    for eager, asynchronous in ((True, False), (False, False), (False, True)):
        llm = LLM(
            str(tiny_llama_dir), dtype=dtype, device="cuda", max_num_seqs=16,
            num_gpu_blocks_override=512, enforce_eager=eager, async_scheduling=asynchronous,
        )  # fmt: skip
        graphs = llm.engine.core.runner.decode_graphs
        assert (graphs is None) == eager
        assert llm.engine.core.info.runtime["cuda_graphs"] == (0 if eager else 5)  # 1 2 4 8 16
        outputs[eager, asynchronous] = generate(llm)
        llm.shutdown()
    assert outputs[False, False] == outputs[True, False]
    assert outputs[False, True] == outputs[True, False]
    assert [len(tokens) for tokens in outputs[False, True]] == [24] * len(PROMPTS)


def test_nothing_compiles_after_ready(tiny_llama_dir: Path) -> None:
    from blockserve import LLM

    for eager in (False, True):
        llm = LLM(
            str(tiny_llama_dir), dtype="bfloat16", device="cuda", max_num_seqs=16,
            num_gpu_blocks_override=512, max_num_batched_tokens=256, enforce_eager=eager,
        )  # fmt: skip
        with TritonCompiles() as compiles:
            generate(llm, max_tokens=40)
        llm.shutdown()
        assert compiles.kernels == []
