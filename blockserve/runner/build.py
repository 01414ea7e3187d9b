"""Assembles a runner's parts from the configs, in one place: the device and its probe, the
attention backend, the KV cache (sized, allocated, on a CPU its pages mapped in ahead), the
weights and their fused operators, the sampler, the grammar compiler, and the compiled forward
under `--compile`. runner/start.py readies them for an engine."""

from __future__ import annotations

import logging
import os
import weakref
from functools import partial

import torch

from blockserve.attention.selector import get_attention_backend
from blockserve.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    default_cache_dir,
)
from blockserve.grammar import GrammarCompiler
from blockserve.kernels import CpuKernels, LayerOpsSource, fits_model
from blockserve.lora.manager import build_lora_manager
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.compile import compile_forward
from blockserve.model.loader import (
    LoadedModel,
    TokenizerSources,
    check_gguf_quantization,
    load_model,
    read_arch,
    resolve_dtype,
    resolve_model_dir,
)
from blockserve.model.sampler import Sampler
from blockserve.model.weight_copies import pack_once_loaded, use_kernels
from blockserve.platform import probe_host, warn_if_slow
from blockserve.runner.dummy_steps import warm_up
from blockserve.runner.kv_budget import (
    LargestStep,
    cuda_memory,
    fixed_kv_bytes,
    full_house_blocks,
    profile_lengths,
    scratch_blocks,
    size_from_memory,
)
from blockserve.runner.kv_cache import allocate_kv_caches, num_blocks_for
from blockserve.runner.model_runner import ModelRunner, RunnerParts
from blockserve.runner.page_mapping import KVPagePopulator, keep_freed_memory

logger = logging.getLogger(__name__)

EAGER = RuntimeConfig()  # the default: the model's own forward, no graphs


def build_runner(
    model_config: ModelConfig, cache_config: CacheConfig, runtime: RuntimeConfig = EAGER
) -> ModelRunner:
    """A runner over `runner_parts` (no page mapping ahead, no warm-up on the device, no decode
    graphs: what the tests and the model benchmarks run; an engine starts its runner with
    start_runner)."""
    return ModelRunner(runner_parts(model_config, cache_config, runtime=runtime))


def runner_parts(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    kv_blocks_per_step: int = 0,
    largest_step: LargestStep | None = None,
    lora_config: LoRAConfig | None = None,
    runtime: RuntimeConfig = EAGER,
) -> RunnerParts:
    """`kv_blocks_per_step`: the most never-used blocks a step can take, their pages mapped
    in ahead on a CPU (page_mapping.py; 0: at first writes). `largest_step`: what the memory
    profile runs when memory sizes the cache. `lora_config`: the adapters (lora/).
    `runtime.compile`: the forward compiled."""
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
    if model_config.quantization == "gguf":  # before anything is allocated
        check_gguf_quantization(model_config.model, dtype, name)
    block_size = cache_config.block_size
    num_blocks = _fixed_num_blocks(cache_config, arch, block_size, dtype, device)
    largest = largest_step or LargestStep()
    profiled = profile_lengths(largest, arch.max_position_embeddings)
    before = cuda_memory(device) if num_blocks is None and device.type == "cuda" else None
    kv_caches = allocate_kv_caches(
        arch, num_blocks or scratch_blocks(profiled, block_size), block_size, dtype, device
    )
    kv_pages = None
    if num_blocks is not None and device.type == "cpu" and kv_blocks_per_step > 0:
        kv_pages = KVPagePopulator(kv_caches, ahead=2 * kv_blocks_per_step)  # while loading
    ours = fits_model(device, dtype, arch.head_dim)  # our CPU kernels run this model
    try:
        loaded = load_model(
            model_config.model,
            backend,
            dtype,
            name,
            model_dir=model_dir,
            kernels=_layer_ops(device, kernels if ours else None),
            sources=TokenizerSources(
                model_config.tokenizer, model_config.download_dir, model_config.chat_template
            ),
            quantization=model_config.quantization,
        )
    except BaseException:
        if kv_pages is not None:  # its thread must not be mapping pages as the process exits
            kv_pages.close()
        raise
    if kv_pages is not None:
        keep_freed_memory()  # for the steps' temporaries; the loading's are gone
        kv_pages.map_now(kv_blocks_per_step)  # the first step writes mapped memory
    if ours:
        _start_cpu_kernels(kernels, dtype, loaded, runtime.compile)
    parts = RunnerParts(
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
    if num_blocks is None:
        context = model_config.max_model_len or arch.max_position_embeddings
        full_house = full_house_blocks(largest, context, block_size)
        size_from_memory(parts, cache_config, profiled, before, full_house)
    if runtime.compile:  # warmed on the parts: their inputs, their cache, their backend
        parts.forward, parts.compile_report = compile_forward(
            loaded.model, backend, default_cache_dir(), partial(warm_up, parts)
        )
    return parts


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


def _layer_ops(device: torch.device, kernels: CpuKernels | None) -> LayerOpsSource | None:
    """The layers' fused operators: Triton's on CUDA (compiled on first use), our CPU
    library's where it runs the model (in use once loaded), else torch's (None)."""
    if device.type == "cuda":
        from blockserve.kernels.triton_layer_ops import GpuKernels

        return GpuKernels()
    return kernels


def _start_cpu_kernels(
    kernels: CpuKernels, dtype: torch.dtype, loaded: LoadedModel, compiled: bool
) -> None:
    """Our CPU library, built or loaded on a thread (torch's operators serve meanwhile), the
    weights packed for it once it is in (`compiled`: the forward will be, over oneDNN's)."""
    use_kernels(loaded.model, kernels)
    pack = pack_once_loaded(weakref.ref(loaded.model), kernels, dtype, compiled)
    kernels.loader.when_loaded(dtype, pack)
    kernels.loader.start(default_cache_dir(), dtype)
