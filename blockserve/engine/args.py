"""`EngineArgs`: every engine option in one flat list (vLLM's names), each declared once: on
the config it fills, or here when it builds something else; `create_configs()` checks them and
builds the frozen configs. Imports no torch: the CLI builds its parser from this module."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from blockserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from blockserve.core.eviction import EVICTION_POLICIES, EvictionConfig, TailLRUConfig
from blockserve.cpu_threads import host_thread_plan
from blockserve.engine import arg_checks
from blockserve.errors import InvalidConfigError
from blockserve.events.config import KVEventsConfig
from blockserve.grammar_limits import ConstraintLimits
from blockserve.options import (
    add_arguments,
    at_least,
    declared,
    from_namespace,
    option,
    options_of,
    positive,
    validate,
)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """The engine's options; `create_configs()` checks them and builds an `EngineConfig`.

    `blockserve serve` generates its flags from these fields (kebab-case) and `LLM(**kwargs)`
    takes exactly these keywords; both build the configs through `create_configs()`. A field
    `declared(Config, name)` is that config's option, its default, help and check written there;
    the others are declared here: they build a config's part (the eviction policy, the
    structured-outputs limits, the adapters) or are vLLM's flags that fill no config.
    """

    # The model (ModelConfig).
    model: str | None = declared(ModelConfig, "model")
    revision: str | None = declared(ModelConfig, "revision")
    download_dir: str | None = declared(ModelConfig, "download_dir")
    tokenizer: str | None = declared(ModelConfig, "tokenizer")
    chat_template: str | None = declared(ModelConfig, "chat_template")
    dtype: str = declared(ModelConfig, "dtype")
    device: str = declared(ModelConfig, "device")
    quantization: str | None = declared(ModelConfig, "quantization")
    attention_backend: str = declared(ModelConfig, "attention_backend")
    max_model_len: int | None = declared(ModelConfig, "max_model_len")
    seed: int = declared(ModelConfig, "seed")
    generation_config: str = declared(ModelConfig, "generation_config")
    max_logprobs: int = declared(ModelConfig, "max_logprobs")
    structured_outputs_max_whitespace: int = declared(
        ModelConfig, "structured_outputs_max_whitespace"
    )
    structured_outputs_max_bytes: int = option(
        65536,
        "structured outputs: the most bytes one constraint may have (a schema's JSON, a "
        "regex, a grammar, or the choices together)",
        check=positive,
    )
    structured_outputs_max_rules: int = option(
        1000,
        "structured outputs: the most rules a grammar may define, or $refs a schema may hold "
        "(the grammar compiler recurses once per rule it follows)",
        check=positive,
    )
    structured_outputs_max_choices: int = option(
        1000, "structured outputs: the most entries a choice list may have", check=positive
    )
    structured_outputs_max_nesting: int = option(
        64,
        "structured outputs: how deep a JSON schema's objects and arrays may nest",
        check=positive,
    )
    structured_outputs_compile_timeout: float = option(
        10.0,
        "structured outputs: seconds a constraint may take to compile before it is refused",
        check=positive,
    )
    allowed_media_domains: tuple[str, ...] = declared(ModelConfig, "allowed_media_domains")
    allowed_local_media_path: str | None = declared(ModelConfig, "allowed_local_media_path")
    mm_hasher_algorithm: str = declared(ModelConfig, "mm_hasher_algorithm")
    mm_processor_cache_gb: float = declared(ModelConfig, "mm_processor_cache_gb")
    limit_mm_per_prompt: dict | str | None = option(
        None,
        "the most images one prompt may hold, as JSON with vLLM's keys: '{\"image\": 4}' or "
        '\'{"image": {"count": 4}}\' (default: 999, vLLM\'s; 0: text only)',
        check=arg_checks.mm_limit,
    )
    # The KV cache, its prefix cache and the tiers below it (CacheConfig).
    enable_prefix_caching: bool = declared(CacheConfig, "enable_prefix_caching")
    block_size: int = declared(CacheConfig, "block_size")
    prefix_caching_hash_algo: str = declared(CacheConfig, "prefix_caching_hash_algo")
    num_gpu_blocks_override: int | None = declared(CacheConfig, "num_gpu_blocks_override")
    kv_cache_memory_bytes: int | None = declared(CacheConfig, "kv_cache_memory_bytes")
    gpu_memory_utilization: float | None = declared(CacheConfig, "gpu_memory_utilization")
    miss_ratio_samples: int = declared(CacheConfig, "miss_ratio_samples")
    eviction_policy: str = option(
        "lru",
        "which free cached block is reused first (docs/prefix-caching.md)",
        choices=EVICTION_POLICIES,
    )
    tlru_threshold_tokens: int = option(
        512,
        "tlru eviction: the prefill tokens a turn may pay within its TTFT budget (xi)",
        check=at_least(0),
    )
    tlru_next_prompt_tokens: int = option(
        128, "tlru eviction: the expected tokens of a conversation's next turn", check=at_least(0)
    )
    kv_offloading_size: float = declared(CacheConfig, "kv_offloading_size")
    kv_cache_dir: str | None = declared(CacheConfig, "kv_cache_dir")
    kv_disk_size: float = declared(CacheConfig, "kv_disk_size")
    kv_cache_dir_clear_mismatch: bool = declared(CacheConfig, "kv_cache_dir_clear_mismatch")
    kv_remote_url: str | None = declared(CacheConfig, "kv_remote_url")
    kv_remote_secret: str | None = declared(CacheConfig, "kv_remote_secret")
    # Continuous batching (SchedulerConfig).
    scheduling_policy: str = declared(SchedulerConfig, "scheduling_policy")
    lpm_aging_s: float = declared(SchedulerConfig, "lpm_aging_s")
    max_num_seqs: int = declared(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = declared(SchedulerConfig, "max_num_batched_tokens")
    max_request_seq_share: float = declared(SchedulerConfig, "max_request_seq_share")
    async_scheduling: bool = declared(SchedulerConfig, "async_scheduling")
    max_n: int = declared(SchedulerConfig, "max_n")
    encoder_cache_size: int | None = declared(SchedulerConfig, "encoder_cache_size")
    # How the model runs (RuntimeConfig).
    cpu_threads: int | None = declared(RuntimeConfig, "cpu_threads")
    compile: bool = declared(RuntimeConfig, "compile")
    enforce_eager: bool = declared(RuntimeConfig, "enforce_eager")
    cuda_graph_sizes: tuple[int, ...] = declared(RuntimeConfig, "cuda_graph_sizes")
    # LoRA adapters (LoRAConfig).
    enable_lora: bool = option(
        False, "serve LoRA adapters: a request names one by `model` (docs/lora.md)"
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "adapters read at start-up (implies --enable-lora), each name=path or vLLM's JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
        check=arg_checks.lora_modules,
    )
    max_loras: int = declared(LoRAConfig, "max_loras")
    max_lora_rank: int = declared(LoRAConfig, "max_lora_rank")
    max_cpu_loras: int | None = declared(LoRAConfig, "max_cpu_loras")
    # KV events (KVEventsConfig).
    kv_events_config: KVEventsConfig | dict | str | None = option(
        None,
        "KV event publishing, as JSON with vLLM's keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
        check=arg_checks.kv_events,
    )
    # vLLM's flags that fill no config: accepted where this engine does what they ask.
    tensor_parallel_size: int = option(
        1, "vLLM's flag; one device per replica here", check=arg_checks.one_device
    )
    enable_chunked_prefill: bool = option(
        True,
        "vLLM's flag: prompts longer than --max-num-batched-tokens are prefilled in chunks "
        "(always, here)",
        check=arg_checks.chunked_prefill,
    )
    swap_space: float | None = option(
        None, "vLLM's old flag, refused as vLLM 0.32 refuses it", check=arg_checks.no_swap_space
    )
    trust_remote_code: bool = option(
        False,
        "vLLM's flag, accepted: the Llama-family models served here run no code of their own",
    )
    load_format: str = option(
        "auto",
        "vLLM's flag: auto (a directory's safetensors, or a .gguf file), safetensors or gguf",
        choices=("auto", "safetensors", "gguf"),
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field."""
        add_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        return from_namespace(cls, namespace)

    def create_configs(self) -> EngineConfig:
        """Validate every field, then the options that go together, then build the frozen
        configs; InvalidConfigError names the first bad field and its flag. Touches no disk
        or network."""
        validate(self)
        self._check_combinations()
        lora = self._lora_config()
        return EngineConfig(
            model=ModelConfig(
                **options_of(ModelConfig, self),
                structured_outputs_limits=self._constraint_limits(),
                max_images_per_prompt=arg_checks.image_limit(self.limit_mm_per_prompt),
            ),
            cache=CacheConfig(
                **options_of(CacheConfig, self) | {"kv_remote_secret": self._remote_secret()},
                eviction=EvictionConfig(
                    self.eviction_policy,
                    TailLRUConfig(self.tlru_threshold_tokens, self.tlru_next_prompt_tokens),
                ),
            ),
            scheduler=SchedulerConfig(
                **options_of(SchedulerConfig, self), max_loras=lora.max_loras if lora else 0
            ),
            kv_events=self._kv_events_config(),
            lora=lora,
            runtime=RuntimeConfig(
                **options_of(RuntimeConfig, self), threads=host_thread_plan(self.cpu_threads)
            ),
        )

    def _check_combinations(self) -> None:
        tiers = self.kv_offloading_size or self.kv_cache_dir or self.kv_remote_url
        if tiers and not self.enable_prefix_caching:
            raise InvalidConfigError(
                "kv_offloading_size, kv_cache_dir and kv_remote_url (--kv-offloading-size, "
                "--kv-cache-dir, --kv-remote-url) are prefix-cache tiers: they need "
                "enable_prefix_caching"
            )
        if self.async_scheduling and tiers:
            raise InvalidConfigError(
                "async_scheduling (--async-scheduling) cannot run with the KV tiers "
                "(--kv-offloading-size, --kv-cache-dir, --kv-remote-url): their loads write "
                "blocks a step in flight may still be writing"
            )
        if (self.enable_lora or self.lora_modules) and self.compile:
            raise InvalidConfigError(
                "enable_lora (--enable-lora) cannot run with --compile: the adapters' products "
                "change with every step's batch"
            )
        gguf = str(self.model or "").endswith(".gguf")
        if self.load_format != "auto" and (self.load_format == "gguf") != gguf:
            raise InvalidConfigError(
                f"load_format (--load-format) {self.load_format} does not fit the model "
                f"{self.model or '(the embedded SmolLM2, safetensors)'}"
            )

    def _constraint_limits(self) -> ConstraintLimits:
        return ConstraintLimits(
            max_bytes=self.structured_outputs_max_bytes,
            max_rules=self.structured_outputs_max_rules,
            max_choices=self.structured_outputs_max_choices,
            max_nesting=self.structured_outputs_max_nesting,
            compile_timeout_s=self.structured_outputs_compile_timeout,
        )

    def _remote_secret(self) -> str | None:
        return self.kv_remote_secret or os.environ.get("BLOCKSERVE_KV_REMOTE_SECRET") or None

    def _lora_config(self) -> LoRAConfig | None:
        if not (self.enable_lora or self.lora_modules):  # adapters to serve imply --enable-lora
            return None
        modules = tuple(arg_checks.lora_module(str(entry)) for entry in self.lora_modules)
        return LoRAConfig(**options_of(LoRAConfig, self), modules=modules)

    def _kv_events_config(self) -> KVEventsConfig | None:
        value = self.kv_events_config
        if value is None or isinstance(value, KVEventsConfig):
            return value
        try:
            if isinstance(value, str):
                return KVEventsConfig.from_json(value)
            return KVEventsConfig.from_dict(value)
        except InvalidConfigError as exc:
            raise InvalidConfigError(f"kv_events_config (--kv-events-config) {exc}") from None
