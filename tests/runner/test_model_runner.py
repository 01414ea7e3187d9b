"""The runner over a tiny random model equals transformers' forward and generate (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM

from blockserve.config import CacheConfig, ModelConfig
from blockserve.runner.build import build_runner
from blockserve.runner.model_runner import ModelRunner
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
FP32_ATOL = 1e-4


def make_runner(model_dir: Path, num_blocks: int = 64) -> ModelRunner:
    return build_runner(
        ModelConfig(model=str(model_dir), dtype="float32"),
        CacheConfig(num_gpu_blocks_override=num_blocks),
    )


def scheduled(
    request_id: str,
    tokens: list[int],
    start: int,
    end: int,
    block_ids: list[int],
    sample: bool,
    new: bool = False,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        token_ids=tuple(tokens[start:end]),
        num_computed_tokens=start,
        block_ids=tuple(block_ids),
        sample=sample,
        new_request=NewRequestData(tuple(tokens), (), GREEDY) if new else None,
    )


def all_logits(runner: ModelRunner, output: SchedulerOutput) -> torch.Tensor:
    """Logits at every scheduled token: [num_tokens, vocab]."""
    inputs = runner.prepare_inputs(output)
    plan = runner.backend.prepare(inputs.metadata)
    with torch.inference_mode():
        hidden = runner.forward(inputs.input_ids, inputs.positions, runner.kv_caches, plan)
        return runner.model.compute_logits(hidden)


def reference_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


class MixedBatch(NamedTuple):
    first: SchedulerOutput  # caches a's 32-token prefix and b's first 20 tokens
    second: SchedulerOutput  # a: 5 on cached blocks, b: a decode, c: a fresh 23-token prefill
    expected: torch.Tensor  # transformers' logits at the second step's 29 tokens


def mixed_batch(model_dir: Path) -> MixedBatch:
    """Two steps; the second mixes a fresh prefill, a prefill on cached prefix blocks, and a
    decode."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (37,), generator=gen).tolist()  # prefix 32 earlier, then 5
    b = torch.randint(0, 300, (21,), generator=gen).tolist()  # 20 earlier, then 1 (decode)
    c = torch.randint(0, 300, (23,), generator=gen).tolist()  # fresh prefill
    first = SchedulerOutput(
        (
            scheduled("a", a, 0, 32, [1, 2], False, new=True),
            scheduled("b", b, 0, 20, [3, 4], False, new=True),
        )
    )
    second = SchedulerOutput(
        (
            scheduled("a", a, 32, 37, [1, 2, 5], True),
            scheduled("b", b, 20, 21, [3, 4], True),
            scheduled("c", c, 0, 23, [6, 7], True, new=True),
        )
    )
    expected = torch.cat(
        [
            reference_logits(model_dir, a)[32:37],
            reference_logits(model_dir, b)[20:21],
            reference_logits(model_dir, c),
        ]
    )
    return MixedBatch(first, second, expected)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_mixed_batch_matches_transformers(
    model_fixture: str, request: pytest.FixtureRequest
) -> None:
    """One step mixing a fresh prefill, a prefill on cached prefix blocks, and a decode."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    runner = make_runner(model_dir)
    batch = mixed_batch(model_dir)
    all_logits(runner, batch.first)
    logits = all_logits(runner, batch.second)
    assert logits.shape == batch.expected.shape == (29, 320)
    assert (logits - batch.expected).abs().max().item() < FP32_ATOL


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """Drive the runner like a scheduler would: prefill all prompts in one step, then decode."""
    block_size = runner.block_size
    next_block = 1
    tables: list[list[int]] = []
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(num_tokens):
        batch = []
        for i, seq in enumerate(tokens):
            if step == 0:
                tables.append([])
            while len(tables[i]) * block_size < len(seq):
                tables[i].append(next_block)
                next_block += 1
            batch.append(scheduled(str(i), seq, computed[i], len(seq), tables[i], True, step == 0))
        result = runner.execute(SchedulerOutput(tuple(batch)))
        for i, seq in enumerate(tokens):
            computed[i] = len(seq)
            token = result.sampled_token_ids[str(i)]
            seq.append(token)
            outputs[i].append(token)
    return outputs


def test_greedy_generation_matches_transformers_generate(tiny_llama_dir: Path) -> None:
    """32 greedy tokens for 3 prompts (lengths 5, 17, 40) equal transformers' generate."""
    runner = make_runner(tiny_llama_dir)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    ours = greedy_generate(runner, prompts, 32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for prompt, generated in zip(prompts, ours, strict=True):
        reference = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert generated == reference
