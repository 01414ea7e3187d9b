"""The frozen configs the engine is built from, and the server's options. The engine's configs are
plain data: `EngineArgs` (engine/args.py) declares, validates and builds them, so nothing here
checks them twice. Nothing here touches disk or network or imports below this layer: the choice
lists that several layers share live here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from blockserve.core.eviction import EvictionConfig
from blockserve.errors import InvalidConfigError
from blockserve.events.config import KVEventsConfig
from blockserve.grammar_limits import ConstraintLimits
from blockserve.options import at_least, option, positive, validate

if TYPE_CHECKING:  # cpu_threads imports torch, which a config never needs
    from blockserve.cpu_threads import ThreadPlan


def default_cache_dir() -> Path:
    """Where start-up caches live (converted GGUF files, tokenizer snapshots, our CPU kernel
    builds): `$BLOCKSERVE_CACHE_DIR`, else `~/.cache/blockserve`."""
    env = os.environ.get("BLOCKSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "blockserve"


DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache and its prefix cache.

    The cache is sized by `num_gpu_blocks_override` (a block count), else by
    `kv_cache_memory_bytes`, else (runner/kv_budget.py) by VLLM_CPU_KVCACHE_SPACE on a CPU, else
    by `gpu_memory_utilization` (its default 0.9 on CUDA; 2 GiB on a CPU when it is None).
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    eviction: EvictionConfig = field(default_factory=EvictionConfig)  # which block goes next
    miss_ratio_samples: int = 4096  # the online miss-ratio curve's hash budget; 0: no curve
    # Tiers below the device (kv_tiers/): a host-memory store and a disk store; 0 / None: off.
    kv_offloading_bytes: int = 0
    kv_cache_dir: str | None = None
    kv_disk_bytes: int = 16 << 30
    kv_cache_dir_clear_mismatch: bool = False
    kv_remote_url: str | None = None  # a Redis-protocol store every replica shares
    # Signs the remote store's records (None: the store is trusted); never printed.
    kv_remote_secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run: its files, dtype, device, context, tokenizer and sampling limits.

    `model` is a Hugging Face directory or a .gguf file; None means the embedded default model.
    `max_model_len` None means the model's own context length. `device` "auto" is CUDA when
    a device is present, else the CPU (resolved by the runner, not here).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # Whitespace the JSON grammar allows between JSON tokens: -1 any, 0 none (compact JSON).
    structured_outputs_max_whitespace: int = 16
    # What one structured-outputs constraint may contain (grammar_limits.py).
    structured_outputs_limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    # Default sampling parameters: "auto" (the model's generation_config.json), "vllm" (none),
    # or a path to the file or its directory.
    generation_config: str = "auto"
    # A hub id's revision, the cache to download into, a tokenizer other than the model's.
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    max_logprobs: int = 20  # the most logprobs a request may ask for
    # The chat template to use instead of the tokenizer's: a file, or the template itself.
    chat_template: str | None = None


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How the model runs, not which: the compiled forward, the decode graphs, the threads."""

    # torch.compile the layers' math between attentions (model/compile.py); off: eager.
    compile: bool = False
    # On CUDA: decode batches eager (True) or replayed from graphs captured at these batch
    # sizes (empty: 1, 2, 4, then every multiple of 8 up to max_num_seqs).
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()
    cpu_threads: int | None = None  # None: adapted to the host (cpu_threads.py)
    # The compute threads on a CPU, planned once from cpu_threads and the host (None: the
    # engine plans them when it starts).
    threads: ThreadPlan | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs`
    running requests; a prompt longer than the budget is prefilled in chunks. `max_model_len`
    is the context the engine settled on (the model's, capped by the KV cache). Under `lpm`, a
    cached prefix moves a request ahead by up to `lpm_aging_s` seconds (sched/lpm.py).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"
    lpm_aging_s: float = 30.0
    max_n: int = 128  # most samples one request may ask for: each is a scheduler request
    # The most of max_num_seqs one request (its samples, its prompts) holds while another
    # waits (sched/fair_share.py); 1: first come, first served, as vLLM.
    max_request_seq_share: float = 0.5
    # Schedule step N+1 while step N runs, its sampled tokens as placeholders (engine/core.py).
    async_scheduling: bool = False
    max_loras: int = 0  # the most distinct LoRA adapters one step may hold (0: LoRA off)
    # Prompt positions a prompt-logprobs request scores per step: each costs a row of logits
    # over the vocabulary, so a long scoring prefill goes in short chunks and leaves the rest
    # of the budget, and the step's time, to others.
    max_scored_tokens_per_step: int = 256


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters (--enable-lora): `max_loras` in the runner's slots at once, ranks up to
    `max_lora_rank`, `max_cpu_loras` kept loaded in host memory (None: `max_loras`), and the
    (name, path) pairs of --lora-modules, read at start-up."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    @property
    def host_capacity(self) -> int:
        return max(self.max_loras, self.max_cpu_loras or self.max_loras)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from; made by `EngineArgs.create_configs()`."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_events: KVEventsConfig | None = None
    lora: LoRAConfig | None = None  # None: --enable-lora not given
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def _port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"must be in 0..65535, got {value!r}"


def _non_empty_strings(values: tuple[str, ...]) -> str | None:
    if not isinstance(values, tuple) or not all(isinstance(v, str) and v for v in values):
        return f"must be a tuple of non-empty strings, got {values!r}"
    return None


def _non_empty_string(value: str) -> str | None:
    return None if value else "must not be empty"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP front end's options (`blockserve serve` flags).

    With no `api_key` every route is open. With keys, every route but `/health` needs one
    (`/metrics` too, unless `metrics_without_auth`). The CLI adds the keys of `api_keys_file`
    and, when no key is given at all, falls back to the BLOCKSERVE_API_KEY variable.
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", check=_port)
    served_model_name: tuple[str, ...] = option(
        (),
        "one or more names the API serves the model under (requests may use any; responses "
        "and metrics use the first); default: the --model string as given, or the embedded "
        "model's name",
        check=_non_empty_strings,
    )
    api_key: tuple[str, ...] = option(
        (),
        "require `Authorization: Bearer KEY` on every route but /health; give several keys "
        "after one flag or repeat it (default: BLOCKSERVE_API_KEY, if set)",
        check=_non_empty_strings,
        secret=True,
    )
    api_keys_file: str | None = option(
        None, "a file of API keys, one per line (blank lines and # comments are skipped)"
    )
    metrics_without_auth: bool = option(False, "serve /metrics without an API key")
    allow_runtime_lora_updating: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; off "
        "by default: a request names a path the server then reads)",
    )
    enable_debug_endpoints: bool = option(
        False, "serve /debug/kv_cache (pool occupancy, which shows other tenants' activity)"
    )
    cache_salt_per_key: bool = option(
        False,
        "derive each request's cache_salt from its API key (a client's own salt is kept "
        "under it), so tenants never share cached blocks",
    )
    max_request_body_bytes: int = option(
        8 << 20,
        "largest request body accepted; a larger one is a 413 before it is read",
        check=positive,
    )
    default_chat_max_tokens: int = option(
        2048,
        "max_tokens of a chat completion that gives neither max_tokens nor "
        "max_completion_tokens (less if the context leaves less)",
        check=positive,
    )
    trust_chat_special_tokens: bool = option(
        False,
        "let special-token text inside chat messages (<|im_start|>, ...) become special "
        "tokens, as it once did; by default it is plain text, so a message cannot forge a turn",
    )
    max_prompts_per_request: int = option(
        2048, "most prompts one completions request may list (OpenAI's bound)", check=positive
    )
    max_stop_strings: int = option(64, "most stop strings one request may give", check=positive)
    max_stop_chars: int = option(
        4096, "most characters one request's stop strings may have together", check=positive
    )
    max_request_tokens: int = option(
        262144,
        "most tokens one request may ask to generate: prompts x n x max_tokens (without "
        "max_tokens, up to the context's end)",
        check=positive,
    )
    header_timeout: float = option(
        10.0,
        "seconds a connection has to send a request's line and headers, from its start or "
        "its previous response; then it is closed",
        check=positive,
    )
    body_timeout: float = option(
        30.0, "seconds to wait for each chunk of a request body; then a 408", check=positive
    )
    stream_write_timeout: float = option(
        30.0,
        "seconds a streamed response may wait on a client that reads nothing; then its "
        "request is aborted (blocks freed) and the connection closed. vLLM has no such bound",
        check=positive,
    )
    timeout_keep_alive: int = option(
        5, "seconds an idle keep-alive connection stays open (uvicorn's)", check=positive
    )
    tokenizer_workers: int = option(
        2, "threads that tokenize prompts and render chat templates", check=positive
    )
    enable_auto_tool_choice: bool = option(
        False,
        'answer tool_choice "auto" (the default once tools are given): the model chooses '
        "between text and calls, read out of its text by --tool-call-parser",
    )
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format, for --enable-auto-tool-choice: hermes "
        '(<tool_call>{"name": ..., "arguments": ...}</tool_call>, as Qwen2.5 and Hermes '
        "models write)",
        choices=TOOL_CALL_PARSERS,
    )
    shutdown_timeout: float = option(
        30.0,
        "seconds running requests get to finish after SIGTERM; then each ends with an error",
        check=at_least(0),
    )
    disable_log_stats: bool = option(False, "no periodic stats line (vLLM's flag)")
    disable_log_requests: bool = option(
        False, "vLLM's older flag, accepted: this server logs no request's contents"
    )
    response_role: str = option(
        "assistant",
        "the role of a chat completion's message when the request adds the generation prompt "
        "(without it, the role of the request's last message), as in vLLM",
        check=_non_empty_string,
    )
    uvicorn_log_level: str = option(
        "info",
        "uvicorn's log level (vLLM's flag)",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        validate(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InvalidConfigError(
                "enable_auto_tool_choice (--enable-auto-tool-choice) needs --tool-call-parser"
            )
