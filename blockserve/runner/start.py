"""`start_runner`: the engine's one call into runner/. It sizes and assembles the parts, settles
the context length, warms the device up, captures the decode graphs and builds the runner over
all of it; the engine gets the runner (steps in, outputs out) and a `RunnerInfo`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from blockserve.config import EngineConfig, ModelConfig, RuntimeConfig
from blockserve.errors import InvalidConfigError
from blockserve.grammar import GrammarCompiler
from blockserve.kernels.cpu import fits_model
from blockserve.lora.manager import LoRAManager
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.loader import LoadedModel
from blockserve.model.tokenizer import Tokenizer
from blockserve.multimodal.media import MediaPolicy
from blockserve.multimodal.processor_cache import ProcessorCache
from blockserve.multimodal.prompts import ImagePrompts
from blockserve.runner.build import runner_parts
from blockserve.runner.decode_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    GraphPlanner,
    KernelWarmUp,
    StaticDecodeInputs,
    graph_batch_sizes,
)
from blockserve.runner.dummy_steps import warm_up
from blockserve.runner.kv_budget import LargestStep
from blockserve.runner.kv_cache import context_length
from blockserve.runner.launched import LaunchedStep
from blockserve.runner.model_runner import ModelRunner, RunnerParts
from blockserve.runner.page_mapping import blocks_per_step

__all__ = ["KVView", "LaunchedStep", "ModelRunner", "RunnerInfo", "start_runner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVView:
    """The KV cache as the tiers below it see it: its tensors (one per layer), whether their
    host copies are pinned (on CUDA), and what to tell the attention backend when a tier
    writes blocks into it."""

    kv_caches: list[torch.Tensor]
    pin_memory: bool
    on_write: Callable[[], None]


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What the engine learns from the runner it started: the model and its tokenizer, the
    cache's size, the context it fits, the runtime for the start-up log and /v1/models, and
    the handles requests reach through (the grammar compiler, the adapters, the KV view)."""

    model_name: str
    model_dir: Path
    dtype: torch.dtype
    arch: LlamaArchConfig
    block_size: int
    num_blocks: int
    max_model_len: int
    tokenizer: Tokenizer
    grammar: GrammarCompiler
    lora: LoRAManager | None
    kv: KVView
    on_cpu: bool
    # Device, CPU architecture and ISA level, native bf16, dtype, compiled, CUDA graphs.
    runtime: Mapping[str, str | int | bool]
    host_line: str  # the host, in one line
    compile_line: str | None  # what --compile compiled, and how long it took
    images: ImagePrompts | None = None  # how prompts take images (a vision-language model)


def _image_prompts(loaded: LoadedModel, model: ModelConfig) -> ImagePrompts | None:
    """A vision-language model's image prompts: its images hashed with the model as given,
    their count and sources bounded by the flags (an --allowed-local-media-path that is not a
    directory stops the start, as in vLLM)."""
    if loaded.vision is None:
        return None
    local = None
    if model.allowed_local_media_path is not None:
        local = Path(model.allowed_local_media_path).resolve()
        if not local.is_dir():
            raise InvalidConfigError(
                f"allowed_local_media_path (--allowed-local-media-path) {local} is not a directory"
            )
    return ImagePrompts(
        processing=loaded.vision.processing,
        tokens_per_tile=loaded.vision.tower.config.tokens_per_tile,
        image_token_id=loaded.vision.image_token_id,
        model_id=model.model or loaded.name,
        hash_algorithm=model.mm_hasher_algorithm,
        cache=(
            ProcessorCache(int(model.mm_processor_cache_gb * 2**30))
            if model.mm_processor_cache_gb > 0
            else None
        ),
        limit=model.max_images_per_prompt,
        media=MediaPolicy(
            allowed_domains=model.allowed_media_domains,
            local_path=local,
            fetch_timeout_s=float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5")),
        ),
    )


def start_runner(config: EngineConfig) -> tuple[ModelRunner, RunnerInfo]:
    """The runner, ready to run its first step with nothing left to compile."""
    sched, cache = config.scheduler, config.cache
    parts = runner_parts(
        config.model,
        cache,
        blocks_per_step(sched.max_num_batched_tokens, sched.max_num_seqs, cache.block_size),
        LargestStep(sched.max_num_batched_tokens, sched.max_num_seqs),
        config.lora,
        config.runtime,
    )
    max_model_len = context_length(
        config.model.max_model_len, parts.arch, parts.num_blocks, cache.block_size
    )
    warm_up_device(parts, max_model_len)
    parts.decode_graphs = capture_decode_graphs(
        parts, config.runtime, sched.max_num_seqs, max_model_len, graph_capture(parts.device)
    )
    runner = ModelRunner(parts)
    loaded = parts.loaded
    info = RunnerInfo(
        model_name=loaded.name,
        model_dir=loaded.model_dir,
        dtype=loaded.dtype,
        arch=parts.arch,
        block_size=parts.block_size,
        num_blocks=parts.num_blocks,
        max_model_len=max_model_len,
        tokenizer=loaded.tokenizer,
        grammar=parts.grammar,
        lora=parts.lora,
        kv=KVView(
            kv_caches=parts.kv_caches,
            pin_memory=parts.device.type == "cuda",
            on_write=parts.backend.forget_kv,
        ),
        on_cpu=parts.device.type == "cpu",
        runtime={
            **parts.host.report(loaded.dtype),
            # our CPU kernels run this model (once built or loaded, its weights then copied)
            "cpu_kernels": fits_model(parts.device, loaded.dtype, parts.arch.head_dim),
            "compiled": parts.compile_report is not None,
            "cuda_graphs": 0 if parts.decode_graphs is None else len(parts.decode_graphs.sizes),
        },
        host_line=parts.host.describe(),
        images=_image_prompts(loaded, config.model),
        compile_line=None if parts.compile_report is None else parts.compile_report.describe(),
    )
    return runner, info


def graph_capture(device: torch.device) -> GraphCapture | None:
    """How decode graphs are captured on `device`: CUDA's graphs, on CUDA alone."""
    return CudaGraphCapture(device) if device.type == "cuda" else None


def warm_up_device(parts: RunnerParts, max_model_len: int) -> None:
    """On CUDA, compile now what a step would otherwise compile mid-run: every attention
    variant the backend can launch, and the layer operators and K/V write (a dummy prefill
    and decode through the forward)."""
    if parts.device.type != "cuda":
        return
    backend = parts.backend
    with torch.inference_mode():
        if isinstance(backend, KernelWarmUp):
            backend.warm_up(parts.kv_caches[0], parts.arch.num_heads, max_model_len)
        warm_up(parts, parts.forward or parts.loaded.model)
    torch.cuda.synchronize(parts.device)


def capture_decode_graphs(
    parts: RunnerParts,
    runtime: RuntimeConfig,
    max_num_seqs: int,
    max_model_len: int,
    capture: GraphCapture | None,
) -> DecodeGraphs | None:
    """Unless --enforce-eager or adapters are served (they vary by step), with a backend that
    plans decode graphs (triton) and a `capture` (CUDA's, on CUDA): the decode forward
    captured at each batch size of --cuda-graph-sizes (vLLM's by default)."""
    backend = parts.backend
    if runtime.enforce_eager or parts.lora is not None or capture is None:
        return None
    if not isinstance(backend, GraphPlanner):
        return None
    sizes = graph_batch_sizes(max_num_seqs, runtime.cuda_graph_sizes)
    if not sizes:
        return None
    inputs = StaticDecodeInputs(
        max_batch=max(sizes),
        max_blocks=-(-max_model_len // parts.block_size),
        block_size=parts.block_size,
        device=parts.device,
    )
    graphs = DecodeGraphs(inputs, sizes)
    arch = parts.arch
    try:
        with torch.inference_mode():
            report = graphs.capture_all(
                parts.forward or parts.loaded.model,
                parts.kv_caches,
                backend,
                (arch.num_heads, arch.num_kv_heads, arch.head_dim),
                capture,
            )
    except Exception:  # the engine still serves, eagerly, as under --enforce-eager
        logger.exception("capturing the decode graphs failed; decode steps run eagerly")
        return None
    logger.info(report.line())
    return graphs
