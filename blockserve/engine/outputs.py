"""What the engine hands back: `RequestOutput` per request (shaped like vLLM's), `EngineStats`
and `KVCacheReport` for whoever watches it; within it, what each core step did
(`EngineCoreOutputs`). Plain frozen data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from blockserve.core.explain import CacheExplanation
from blockserve.core.kv_cache_manager import RequestId
from blockserve.sched.output import RequestUpdate

# A sample admitted this step: its id, its prefix-cache hit in tokens, the explanation asked
# for, the part of the hit from each lower tier.
Started = tuple[RequestId, int, CacheExplanation | None, dict[str, int]]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One position's log-probability, with the top alternatives (token id → logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample: cumulative text and token ids so far."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[Logprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Monotonic-clock times (seconds) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A snapshot of one request after a step: every sample's text and tokens so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    num_cached_tokens: int
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # Why the prefix-cache match stopped; only for requests that asked (explain_cache).
    cache_explanation: CacheExplanation | None = None
    # The part of num_cached_tokens loaded from each tier below the device ("host", "disk",
    # "remote").
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    # prompt_logprobs, when asked: None for the first token, then each prompt token's logprob
    # given those before it, with the top alternatives (as vLLM's RequestOutput has them).
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class CoreStats:
    """The engine core's gauges and counters, taken between two steps."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class TierStats:
    """One KV tier below the device (host, disk or remote): counters since start and gauges."""

    name: str
    hits: int  # blocks read
    stores: int  # blocks written
    evictions: int
    corrupt: int  # blocks found damaged and dropped
    used_bytes: int
    capacity_bytes: int
    loads: int  # loads that read from this tier
    load_seconds: float  # their total time reading from it
    dropped_writes: int  # blocks not written because the write queue was full (all tiers)
    misses: int = 0  # blocks looked for and not found (or found damaged)
    failures: int = 0  # calls that found the store down, slow or refusing (remote)


@dataclass(frozen=True, slots=True)
class ImageStats:
    """A vision-language model's image work since the start, and its encoder cache now."""

    processor_cache_queries: int  # images looked up in the processor cache (vLLM's mm_cache_*)
    processor_cache_hits: int
    encoded_images: int  # images the vision tower ran on
    encoder_seconds: float  # the tower's time, all steps together
    encoder_cache_embeds: int  # embeddings the encoder cache holds for running requests ...
    encoder_cache_size: int  # ... of this many


@dataclass(frozen=True, slots=True)
class EngineStats(CoreStats):
    """The core's stats and the output processor's token counts: what metrics and the stats
    log line read."""

    num_prompt_tokens: int
    num_generation_tokens: int
    # The online miss-ratio curve at a few cache sizes: (capacity in blocks, LRU token hit
    # rate it would have had on all traffic so far); empty when prefix caching is off.
    estimated_hit_rates: tuple[tuple[int, float], ...] = ()
    kv_tiers: tuple[TierStats, ...] = ()
    lora: LoRAStats | None = None  # None: --enable-lora not given
    images: ImageStats | None = None  # None: a text model


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The adapters of the running and the waiting requests (vLLM's lora_requests_info)."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    loads: int = 0  # adapters read again after leaving host memory (--max-cpu-loras)
    load_seconds: float = 0.0  # what those reads took


@dataclass(frozen=True, slots=True)
class KVCacheReport:
    """The block pool's occupancy and its integrity check (an empty list when sound)."""

    num_blocks: int
    num_free_blocks: int
    usage: float
    num_cached_hashes: int
    num_requests_holding_blocks: int
    integrity_errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MissRatioPoint:
    capacity_blocks: int
    capacity_tokens: int
    estimated_hit_rate: float


@dataclass(frozen=True, slots=True)
class MissRatioReport:
    """The online miss-ratio curve: the token hit rate an LRU prefix cache of each size would
    have had on all traffic since start (docs/prefix-caching.md shows how to read it).
    `actual_hit_rate` is this cache's own, over the same requests."""

    block_size: int
    num_blocks: int  # this cache's usable blocks
    actual_hit_rate: float
    num_requests: int
    sampling_rate: float
    num_tracked_hashes: int
    points: tuple[MissRatioPoint, ...]


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """What one step did: token updates, samples admitted (or re-admitted) this step with
    their prefix-cache hit (in tokens, and the part of it from each lower tier), and samples
    that failed, with the error. Ids are the ones the samples were added with (`SampleId`s,
    from the engine)."""

    timestamp: float
    updates: tuple[RequestUpdate, ...] = ()
    started: tuple[Started, ...] = ()
    errors: Mapping[RequestId, str] = field(default_factory=dict)
