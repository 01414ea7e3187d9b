"""`--compile`: the compiled forward equals eager and transformers (float32) on mixed batches,
and the next start loads its graphs from inductor's on-disk cache instead of building them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from blockserve.config import CacheConfig, ModelConfig, RuntimeConfig
from blockserve.model.compile import CompileReport
from blockserve.runner.build import build_runner
from blockserve.runner.model_runner import ModelRunner
from tests.runner.test_model_runner import FP32_ATOL, all_logits, greedy_generate, mixed_batch

# Graphs per start: one forward for steps of any number of tokens.
GRAPHS = 1
# The KV cache's shape is part of the graphs: every start here sizes it alike.
NUM_BLOCKS = 64


class Runners(NamedTuple):
    eager: ModelRunner
    compiled: ModelRunner
    cache_dir: Path  # the compiled runner's BLOCKSERVE_CACHE_DIR


@pytest.fixture(scope="module")
def runners(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runners:
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    # Forget graphs this process may have compiled before: this start must compile its own.
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKSERVE_CACHE_DIR", str(cache_dir))
        compiled = build_runner(
            ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
            CacheConfig(num_gpu_blocks_override=NUM_BLOCKS),
            runtime=RuntimeConfig(compile=True),
        )
    eager = build_runner(
        ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
        CacheConfig(num_gpu_blocks_override=NUM_BLOCKS),
    )
    return Runners(eager, compiled, cache_dir)


@pytest.mark.slow
def test_a_compiled_start_builds_its_graphs_into_the_cache(runners: Runners) -> None:
    assert runners.eager.compile_report is None
    assert runners.eager.forward is runners.eager.model
    assert runners.compiled.forward is not runners.compiled.model
    report = runners.compiled.compile_report
    assert isinstance(report, CompileReport)
    assert (report.graphs, report.cache_misses, report.cache_hits) == (GRAPHS, GRAPHS, 0)
    assert report.cache_dir == str(runners.cache_dir / "inductor")
    assert any(Path(report.cache_dir).iterdir())


@pytest.mark.slow
def test_compiled_mixed_batch_equals_eager_and_transformers(
    runners: Runners, tiny_llama_dir: Path
) -> None:
    """A fresh prefill, a prefill on cached blocks and a decode in one step."""
    batch = mixed_batch(tiny_llama_dir)
    logits = []
    for runner in (runners.eager, runners.compiled):
        all_logits(runner, batch.first)
        logits.append(all_logits(runner, batch.second))
    eager, compiled = logits
    assert compiled.shape == batch.expected.shape == (29, 320)
    assert (compiled - eager).abs().max().item() < FP32_ATOL
    assert (compiled - batch.expected).abs().max().item() < FP32_ATOL


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_eager(runners: Runners) -> None:
    """24 greedy tokens for 3 prompts (5, 17 and 40 tokens): one step prefilling all three,
    then 23 decode steps of 3 tokens, through the general graph; every token equal."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    eager, compiled = (
        greedy_generate(runner, prompts, 24) for runner in (runners.eager, runners.compiled)
    )
    assert compiled == eager
    assert [len(tokens) for tokens in compiled] == [24, 24, 24]


@pytest.mark.slow
def test_single_token_steps_equal_eager(runners: Runners) -> None:
    """One prompt alone: its decode steps are one-token batches (the same graph)."""
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    eager, compiled = (
        greedy_generate(runner, [prompt], 12) for runner in (runners.eager, runners.compiled)
    )
    assert compiled == eager


START = f"""
import dataclasses, json, sys
from blockserve.config import CacheConfig, ModelConfig, RuntimeConfig
from blockserve.runner.build import build_runner
runner = build_runner(
    ModelConfig(model=sys.argv[1], dtype="float32"),
    CacheConfig(num_gpu_blocks_override={NUM_BLOCKS}),
    runtime=RuntimeConfig(compile=True),
)
print(json.dumps(dataclasses.asdict(runner.compile_report)))
"""


def start_compiled(model_dir: Path, cache_dir: Path) -> dict:
    """A new process builds a compiled runner; its CompileReport."""
    env = {**os.environ, "BLOCKSERVE_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", START, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_next_start_loads_the_graphs_from_the_cache(
    runners: Runners, tiny_llama_dir: Path
) -> None:
    """A new process with the same cache directory builds nothing."""
    report = start_compiled(tiny_llama_dir, runners.cache_dir)
    assert (report["graphs"], report["cache_misses"], report["cache_hits"]) == (GRAPHS, 0, GRAPHS)
    assert report["cache_dir"] == str(runners.cache_dir / "inductor")
