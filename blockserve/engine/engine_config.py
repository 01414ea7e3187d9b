"""`EngineArgs` (checked one by one) to the frozen configs an engine is built from: the checks
across options, then each config."""

from __future__ import annotations

import os
from typing import Any

from blockserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from blockserve.core.eviction import EvictionConfig, TailLRUConfig
from blockserve.cpu_threads import host_thread_plan
from blockserve.engine import arg_checks
from blockserve.errors import InvalidConfigError
from blockserve.events.config import KVEventsConfig
from blockserve.grammar_limits import ConstraintLimits

# `args` is an EngineArgs (engine/args.py imports this module, so this one cannot import it
# back; tests/engine/test_args.py builds every field through here).
EngineArgs = Any

GIB = 1 << 30


def engine_config(args: EngineArgs) -> EngineConfig:
    """The frozen configs of options already checked one by one: the checks across
    options, then each config."""
    _check_combinations(args)
    return EngineConfig(
        model=_model_config(args),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            eviction=EvictionConfig(
                args.eviction_policy,
                TailLRUConfig(args.tlru_threshold_tokens, args.tlru_next_prompt_tokens),
            ),
            miss_ratio_samples=args.miss_ratio_samples,
            kv_offloading_bytes=int(args.kv_offloading_size * GIB),
            kv_cache_dir=args.kv_cache_dir,
            kv_disk_bytes=int(args.kv_disk_size * GIB),
            kv_cache_dir_clear_mismatch=args.kv_cache_dir_clear_mismatch,
            kv_remote_url=args.kv_remote_url,
            kv_remote_secret=(
                args.kv_remote_secret or os.environ.get("BLOCKSERVE_KV_REMOTE_SECRET") or None
            ),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
            lpm_aging_s=float(args.lpm_aging_s),
            max_n=args.max_n,
            max_request_seq_share=args.max_request_seq_share,
            max_loras=args.max_loras if args.enable_lora or args.lora_modules else 0,
        ),
        kv_events=_kv_events_config(args),
        lora=_lora_config(args),
        runtime=RuntimeConfig(
            compile=args.compile,
            enforce_eager=args.enforce_eager,
            cuda_graph_sizes=tuple(int(size) for size in args.cuda_graph_sizes),
            cpu_threads=args.cpu_threads,
            threads=host_thread_plan(args.cpu_threads),
        ),
    )


def _check_combinations(args: EngineArgs) -> None:
    tiers = args.kv_offloading_size or args.kv_cache_dir or args.kv_remote_url
    if tiers and not args.enable_prefix_caching:
        raise InvalidConfigError(
            "kv_offloading_size, kv_cache_dir and kv_remote_url (--kv-offloading-size, "
            "--kv-cache-dir, --kv-remote-url) are prefix-cache tiers: they need "
            "enable_prefix_caching"
        )
    if args.async_scheduling and tiers:
        raise InvalidConfigError(
            "async_scheduling (--async-scheduling) cannot run with the KV tiers "
            "(--kv-offloading-size, --kv-cache-dir, --kv-remote-url): their loads write "
            "blocks a step in flight may still be writing"
        )
    if (args.enable_lora or args.lora_modules) and args.compile:
        raise InvalidConfigError(
            "enable_lora (--enable-lora) cannot run with --compile: the adapters' products "
            "change with every step's batch"
        )
    gguf = str(args.model or "").endswith(".gguf")
    if args.load_format != "auto" and (args.load_format == "gguf") != gguf:
        raise InvalidConfigError(
            f"load_format (--load-format) {args.load_format} does not fit the model "
            f"{args.model or '(the embedded SmolLM2, safetensors)'}"
        )


def _model_config(args: EngineArgs) -> ModelConfig:
    return ModelConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        seed=args.seed,
        structured_outputs_max_whitespace=args.structured_outputs_max_whitespace,
        structured_outputs_limits=ConstraintLimits(
            max_bytes=args.structured_outputs_max_bytes,
            max_rules=args.structured_outputs_max_rules,
            max_choices=args.structured_outputs_max_choices,
            max_nesting=args.structured_outputs_max_nesting,
            compile_timeout_s=args.structured_outputs_compile_timeout,
        ),
        generation_config=args.generation_config,
        revision=args.revision,
        download_dir=args.download_dir,
        tokenizer=args.tokenizer,
        max_logprobs=args.max_logprobs,
        chat_template=args.chat_template,
    )


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not (args.enable_lora or args.lora_modules):  # adapters to serve imply --enable-lora
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=tuple(arg_checks.lora_module(str(entry)) for entry in args.lora_modules),
    )


def _kv_events_config(args: EngineArgs) -> KVEventsConfig | None:
    value = args.kv_events_config
    if value is None or isinstance(value, KVEventsConfig):
        return value
    try:
        if isinstance(value, str):
            return KVEventsConfig.from_json(value)
        return KVEventsConfig.from_dict(value)
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"kv_events_config (--kv-events-config) {exc}") from None
