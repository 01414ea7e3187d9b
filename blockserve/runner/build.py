"""Assembles a `ModelRunner` from the configs, in one place: the device and its probe, the
attention backend, the KV cache (sized, allocated, on a CPU its pages mapped in ahead), the
weights, our CPU kernels' load and packing, the sampler, the grammar compiler, and the
compiled forward under `--compile`. The runner it returns only runs steps."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch

from blockserve.attention.metadata import AttentionBackend
from blockserve.attention.selector import get_attention_backend
from blockserve.config import CacheConfig, LoRAConfig, ModelConfig, default_cache_dir
from blockserve.errors import ModelNotFoundError
from blockserve.grammar import GrammarCompiler
from blockserve.kernels import CpuKernels, fits_model
from blockserve.lora.manager import build_lora_manager
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.compile import compile_forward
from blockserve.model.hub import TOKENIZER_FILES, is_hub_id, snapshot
from blockserve.model.loader import (
    LoadedModel,
    load_model,
    read_arch,
    resolve_dtype,
    resolve_model_dir,
)
from blockserve.model.packed import pack_once_loaded, use_kernels
from blockserve.model.sampler import Sampler
from blockserve.platform import probe_host, warn_if_slow
from blockserve.runner.decode_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    GraphPlanner,
    GraphReport,
    KernelWarmUp,
    StaticDecodeInputs,
    graph_batch_sizes,
)
from blockserve.runner.kv_budget import (
    LargestStep,
    cuda_memory,
    fixed_kv_bytes,
    profile_lengths,
    scratch_blocks,
    size_from_memory,
)
from blockserve.runner.kv_cache import allocate_kv_caches, num_blocks_for
from blockserve.runner.model_runner import ModelRunner, RunnerParts
from blockserve.runner.page_mapping import KVPagePopulator, keep_freed_memory

logger = logging.getLogger(__name__)


def build_runner(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    kv_blocks_per_step: int = 0,
    largest_step: LargestStep | None = None,
    lora_config: LoRAConfig | None = None,
) -> ModelRunner:
    """`kv_blocks_per_step`: the most never-used blocks a step can take, their pages mapped
    in ahead on a CPU (page_mapping.py; 0: at first writes). `largest_step`: what the memory
    profile runs when memory sizes the cache. `lora_config`: the adapters (lora/)."""
    name = _device_name(model_config.device)
    device = torch.device(name)
    kernels = CpuKernels()  # ours once loaded (a thread builds or loads them); torch's before
    backend = get_attention_backend(model_config.attention_backend, name, kernels)
    host = probe_host(device)
    dtype = resolve_dtype(model_config.dtype, host)
    warn_if_slow(dtype, host)
    model_dir = resolve_model_dir(
        model_config.model, revision=model_config.revision, download_dir=model_config.download_dir
    )
    arch = read_arch(model_dir)
    block_size = cache_config.block_size
    num_blocks = _fixed_num_blocks(cache_config, arch, block_size, dtype, device)
    profiled = profile_lengths(largest_step or LargestStep(), arch.max_position_embeddings)
    before = cuda_memory(device) if num_blocks is None and device.type == "cuda" else None
    kv_caches = allocate_kv_caches(
        arch, num_blocks or scratch_blocks(profiled, block_size), block_size, dtype, device
    )
    kv_pages = None
    if num_blocks is not None and device.type == "cpu" and kv_blocks_per_step > 0:
        kv_pages = KVPagePopulator(kv_caches, ahead=2 * kv_blocks_per_step)  # while loading
    loaded = _load_model(model_config, backend, dtype, name, model_dir)
    if kv_pages is not None:
        keep_freed_memory()  # for the steps' temporaries; the loading's are gone
        kv_pages.map_now(kv_blocks_per_step)  # the first step writes mapped memory
    _start_cpu_kernels(kernels, device, dtype, arch, loaded)
    runner = ModelRunner(
        RunnerParts(
            device=device,
            host=host,
            backend=backend,
            arch=arch,
            block_size=block_size,
            num_blocks=kv_caches[0].shape[1],
            kv_caches=kv_caches,
            kv_pages=kv_pages,
            loaded=loaded,
            sampler=_seeded_sampler(model_config.seed, device, kernels),
            kernels=kernels,
            grammar=_grammar_compiler(model_config, loaded, arch),
            lora=build_lora_manager(lora_config, loaded.model, arch, dtype, device, kernels),
        )
    )
    if num_blocks is None:
        size_from_memory(runner, cache_config, profiled, before)
    if model_config.compile:  # warmed on the runner: its inputs, its cache, its backend
        runner.use_compiled(
            *compile_forward(runner.model, backend, default_cache_dir(), runner.warm_up)
        )
    return runner


def _seeded_sampler(seed: int, device: torch.device, kernels: CpuKernels) -> Sampler:
    """Unseeded requests draw from one generator seeded by --seed: a run is reproducible."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return Sampler(generator, kernels)


def _fixed_num_blocks(
    cache_config: CacheConfig,
    arch: LlamaArchConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int | None:
    """The block count the flags fix before the model loads; None when the memory left
    after it decides (--gpu-memory-utilization)."""
    if cache_config.num_gpu_blocks_override is not None:
        return num_blocks_for(arch, block_size, dtype, cache_config.num_gpu_blocks_override, None)
    nbytes = fixed_kv_bytes(cache_config, device.type, os.environ)
    if nbytes is None:
        return None
    return num_blocks_for(arch, block_size, dtype, None, nbytes)


def warm_up_device(runner: ModelRunner, max_model_len: int) -> None:
    """On CUDA, compile now what a step would otherwise compile mid-run: every attention
    variant the backend can launch, and the layer operators and K/V write (a dummy prefill
    and decode through the forward)."""
    if runner.device.type != "cuda":
        return
    backend = runner.backend
    with torch.inference_mode():
        if isinstance(backend, KernelWarmUp):
            backend.warm_up(runner.kv_caches[0], runner.arch.num_heads, max_model_len)
        runner.warm_up(runner.forward)
    torch.cuda.synchronize(runner.device)


def capture_decode_graphs(
    runner: ModelRunner,
    model_config: ModelConfig,
    max_num_seqs: int,
    max_model_len: int,
    capture: GraphCapture | None = None,
) -> GraphReport | None:
    """Unless --enforce-eager, on CUDA with a backend that plans decode graphs (triton):
    capture the decode forward at each batch size of --cuda-graph-sizes (vLLM's by default)
    and hand the graphs to the runner. With `capture` (tests), on any device."""
    backend = runner.backend
    if model_config.enforce_eager or runner.lora is not None:  # adapters vary by step
        return None
    if not isinstance(backend, GraphPlanner):
        return None
    if capture is None:
        if runner.device.type != "cuda":
            return None
        capture = CudaGraphCapture(runner.device)
    sizes = graph_batch_sizes(max_num_seqs, model_config.cuda_graph_sizes)
    if not sizes:
        return None
    max_blocks = -(-max_model_len // runner.block_size)
    inputs = StaticDecodeInputs(
        max_batch=max(sizes), max_blocks=max_blocks, block_size=runner.block_size,
        device=runner.device,
    )  # fmt: skip
    graphs = DecodeGraphs(inputs, sizes)
    arch = runner.arch
    try:
        with torch.inference_mode():
            report = graphs.capture_all(
                runner.forward, runner.kv_caches, backend,
                (arch.num_heads, arch.num_kv_heads, arch.head_dim), capture,
            )  # fmt: skip
    except Exception:  # the engine still serves, eagerly, as under --enforce-eager
        logger.exception("capturing the decode graphs failed; decode steps run eagerly")
        return None
    runner.decode_graphs = graphs
    return report


def _load_model(
    model_config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    model_dir: Path,
) -> LoadedModel:
    """The weights and the tokenizer (--tokenizer's, with --chat-template's template)."""
    loaded = load_model(
        model_config.model, backend, dtype, device, model_dir=model_dir,
        tokenizer_dir=_tokenizer_dir(model_config),
    )  # fmt: skip
    if model_config.chat_template is not None:
        loaded.tokenizer.chat_template = chat_template_text(model_config.chat_template)
    return loaded


def _tokenizer_dir(model_config: ModelConfig) -> Path | None:
    """--tokenizer's directory (a path, or a hub id's snapshot of its tokenizer files)."""
    name = model_config.tokenizer
    if name is None:
        return None
    if is_hub_id(name):
        return snapshot(name, download_dir=model_config.download_dir, files=TOKENIZER_FILES)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"no tokenizer at {name!r}: expected a directory or a hub id")
    return path


def chat_template_text(value: str) -> str:
    """--chat-template's template: the file it names, or the value itself (as vLLM reads it)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    return value


def _device_name(configured: str) -> str:
    """`auto`: CUDA where torch sees a device, else the CPU."""
    if configured != "auto":
        return configured
    return "cuda" if torch.cuda.is_available() else "cpu"


def _grammar_compiler(
    model_config: ModelConfig, loaded: LoadedModel, arch: LlamaArchConfig
) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer=loaded.tokenizer,
        vocab_size=arch.vocab_size,
        eos_token_ids=arch.eos_token_ids,
        max_whitespace=model_config.structured_outputs_max_whitespace,
        limits=model_config.structured_outputs_limits,
    )


def _start_cpu_kernels(
    kernels: CpuKernels,
    device: torch.device,
    dtype: torch.dtype,
    arch: LlamaArchConfig,
    loaded: LoadedModel,
) -> None:
    """Hand the model our kernels: on CUDA Triton's layer operators; on a CPU our library's,
    built or loaded on a thread (torch's serve meanwhile), the weights packed once it is in."""
    if device.type == "cuda":  # Triton's fused layer operators (compiled on first use)
        from blockserve.kernels.triton_layer_ops import GpuKernels

        loaded.model.kernels = GpuKernels()
        return
    if not fits_model(device, dtype, arch.head_dim):
        return
    loaded.model.kernels = kernels
    use_kernels(loaded.model, kernels)
    kernels.loader.when_loaded(dtype, pack_once_loaded(weakref.ref(loaded.model), kernels, dtype))
    kernels.loader.start(default_cache_dir(), dtype)
