"""`--compile`: the model's whole forward compiled by torch.compile (inductor) into one graph."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockserve.attention.metadata import AttentionBackend
from blockserve.model.attention_op import AttentionStep
from blockserve.model.llama import LlamaForCausalLM

# Everything but attention is traced: the embedding lookup, RoPE, every layer's RMSNorms,
# products, SiLU × up and residual adds. Inductor fuses the elementwise passes into a few C++
# loops around oneDNN's products (`blockserve::packed_linear`) and calls attention as an opaque
# operator (`blockserve::attention`, model/attention_op.py), so a step is one call of the graph
# rather than ~600 eager operators: the overhead that dominates small decode batches goes.
#
# The token dimension is traced as an unbacked size (no guard on its value: a dynamic size would
# be specialised apart from 0 and 1 and give single-token steps a second graph, doubling the
# compile) and the step's attention plan is an opaque input, so one graph serves every step. It is
# compiled at start-up on dummy steps (the runner's warm-up, handed to `compile_forward`), on the
# thread that will run the model: no request waits for a compile.
#
# Inductor's caches live under `<cache dir>/inductor` (`TORCHINDUCTOR_CACHE_DIR` points there
# while the graphs compile, whatever it was before): a second start with the same model, dtype and
# torch loads the compiled graphs instead of generating and building C++ again, though it still
# traces the model. `CompileReport` says which happened.


@dataclass(frozen=True, slots=True)
class CompileReport:
    seconds: float  # compiling at start-up, warm-up steps included
    graphs: int  # graphs dynamo captured
    cache_hits: int  # graphs inductor loaded from its on-disk cache
    cache_misses: int  # graphs inductor generated and built
    cache_dir: str

    def describe(self) -> str:
        return (
            f"compiled {self.graphs} graphs in {self.seconds:.1f} s "
            f"({self.cache_hits} from the cache, {self.cache_misses} built; {self.cache_dir})"
        )


class CompiledForward:
    """Called like the model: (input_ids, positions, kv_caches, plan) → hidden states."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend
        self._compiled = torch.compile(type(model).forward)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: Any,
    ) -> torch.Tensor:
        step = AttentionStep(self.backend, plan)
        return self._compiled(self.model, input_ids, positions, kv_caches, step)


def compile_forward(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    cache_dir: Path,
    warm_up: Callable[[CompiledForward], None],
) -> tuple[CompiledForward, CompileReport]:
    """The compiled forward, after `warm_up` has run it on every graph's kind of step."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    # Build in this process: the default starts a pool of compile workers that outlives the
    # compile, for the few C++ kernels these graphs need.
    inductor_config.compile_threads = 1
    before = (
        counters["stats"]["unique_graphs"],
        counters["inductor"]["fxgraph_cache_hit"],
        counters["inductor"]["fxgraph_cache_miss"],
    )
    forward = CompiledForward(model, backend)
    directory = str(cache_dir / "inductor")
    start = time.perf_counter()
    with inductor_cache_dir(directory), torch.inference_mode():
        warm_up(forward)
    report = CompileReport(
        seconds=time.perf_counter() - start,
        graphs=counters["stats"]["unique_graphs"] - before[0],
        cache_hits=counters["inductor"]["fxgraph_cache_hit"] - before[1],
        cache_misses=counters["inductor"]["fxgraph_cache_miss"] - before[2],
        cache_dir=directory,
    )
    return forward, report


def mark_token_dim_dynamic(*tensors: torch.Tensor) -> None:
    """Trace dimension 0 (tokens) of these inputs as a symbol, not the warm-up's size."""
    for tensor in tensors:
        torch._dynamo.decorators.mark_unbacked(tensor, 0)


@contextmanager
def inductor_cache_dir(directory: str) -> Iterator[None]:
    """Inductor reads its cache directory from the environment at each use."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
