"""Prometheus metrics and the stats log line. vLLM's metrics twice: as `vllm:` with vLLM's labels
(`model_name`, `engine`), for dashboards written for vLLM, and as `blockserve:`; ours under
`blockserve:` only. Engine state is read at scrape time, latencies as requests finish; each
app has its own registry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockserve.engine.client import EngineClient
from blockserve.engine.outputs import EngineStats, ImageStats, LoRAStats

logger = logging.getLogger("blockserve.stats")

# vLLM 0.32's finish reasons (FinishReason): each has its request_success series from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class EngineCollector(Collector):
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = [self.model_name]
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be admitted.", stats.num_waiting),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks held by requests (0-1).",
                stats.kv_cache_usage,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield from _twins(GaugeMetricFamily, name, doc, self.model_name, value)
        if stats.estimated_hit_rates:
            curve = GaugeMetricFamily(
                "blockserve:prefix_cache_hit_rate_estimate",
                "Token hit rate (0-1) an LRU prefix cache of capacity_blocks blocks would have "
                "had on all traffic so far (the online miss-ratio curve).",
                labels=["model_name", "capacity_blocks"],
            )
            for capacity, rate in stats.estimated_hit_rates:
                curve.add_metric([*labels, str(capacity)], rate)
            yield curve
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            "num_preemptions": ("Preemptions (recompute).", stats.num_preemptions),
            "prompt_tokens": (
                "Prompt tokens of requests that produced output.",
                stats.num_prompt_tokens,
            ),
            "generation_tokens": ("Tokens generated.", stats.num_generation_tokens),
        }
        for name, (doc, value) in counters.items():
            yield from _twins(CounterMetricFamily, name, doc, self.model_name, value)
        if stats.images is not None:
            yield from _image_metrics(stats.images, self.model_name)
        if stats.kv_tiers:
            yield from _tier_metrics(stats, labels)
        if stats.lora is not None:
            yield _lora_info(stats.lora)
            reads = {
                "lora_loads": ("Adapters read again after leaving host memory.", stats.lora.loads),
                "lora_load_seconds": ("Seconds those reads took.", stats.lora.load_seconds),
            }
            for name, (doc, value) in reads.items():
                counter = CounterMetricFamily(f"blockserve:{name}", doc, labels=["model_name"])
                counter.add_metric(labels, value)
                yield counter


# vLLM's engine label: this server is one engine (data-parallel rank 0).
VLLM_ENGINE = "0"


def _twins(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    model_name: str,
    value: float,
) -> Iterator[Metric]:
    """One value as `vllm:{name}` (model_name, engine) and `blockserve:{name}` (model_name)."""
    vllm = family(f"vllm:{name}", doc, labels=["model_name", "engine"])
    vllm.add_metric([model_name, VLLM_ENGINE], value)
    ours = family(f"blockserve:{name}", doc, labels=["model_name"])
    ours.add_metric([model_name], value)
    yield from (vllm, ours)


def _image_metrics(images: ImageStats, model_name: str) -> Iterator[Metric]:
    """vLLM's processor-cache counters (as `vllm:` and `blockserve:`), and ours: the vision
    tower's images and seconds, the encoder cache's use."""
    twins = {
        "mm_cache_queries": (
            "Multi-modal cache queries, in terms of number of queried items.",
            images.processor_cache_queries,
        ),
        "mm_cache_hits": (
            "Multi-modal cache hits, in terms of number of cached items.",
            images.processor_cache_hits,
        ),
    }
    for name, (doc, value) in twins.items():
        yield from _twins(CounterMetricFamily, name, doc, model_name, value)
    ours: dict[str, tuple[str, float]] = {
        "encoder_images": ("Images the vision tower encoded.", images.encoded_images),
        "encoder_seconds": ("Seconds the vision tower ran, all steps.", images.encoder_seconds),
    }
    for name, (doc, amount) in ours.items():
        counter = CounterMetricFamily(f"blockserve:{name}", doc, labels=["model_name"])
        counter.add_metric([model_name], amount)
        yield counter
    usage = GaugeMetricFamily(
        "blockserve:encoder_cache_usage_perc",
        "Fraction of the encoder cache's embeddings held (0-1).",
        labels=["model_name"],
    )
    usage.add_metric([model_name], images.encoder_cache_embeds / images.encoder_cache_size)
    yield usage


_TIER_COUNTERS = {
    "hits": "Blocks read from the tier.",
    "stores": "Blocks written to the tier.",
    "evictions": "Blocks the tier evicted to make room.",
    "corrupt": "Blocks found damaged in the tier and dropped (their tokens were computed).",
    "loads": "Request loads that read blocks from the tier.",
    "load_seconds": "Total seconds those loads spent reading from the tier.",
    "misses": "Blocks looked for in the tier and not found there.",
    "failures": "Calls that found the tier's store down, slow or refusing (remote).",
}


def _lora_info(lora: LoRAStats) -> Metric:
    """vLLM's: one sample whose labels name the running and waiting adapters, its value the
    time it was taken."""
    gauge = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    values = [str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)]
    gauge.add_metric(values, time.time())
    return gauge


def _tier_metrics(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """One family per counter with a `tier` label (host, disk, remote), and the tiers'
    bytes."""
    for name, doc in _TIER_COUNTERS.items():
        family = CounterMetricFamily(
            f"blockserve:kv_tier_{name}", doc, labels=["model_name", "tier"]
        )
        for tier in stats.kv_tiers:
            family.add_metric([*labels, tier.name], getattr(tier, name))
        yield family
    for name, doc in (
        ("used_bytes", "Bytes of KV the tier holds."),
        ("capacity_bytes", "Bytes of KV the tier may hold."),
    ):
        gauge = GaugeMetricFamily(f"blockserve:kv_tier_{name}", doc, labels=["model_name", "tier"])
        for tier in stats.kv_tiers:
            gauge.add_metric([*labels, tier.name], getattr(tier, name))
        yield gauge
    dropped = CounterMetricFamily(
        "blockserve:kv_tier_dropped_writes",
        "Blocks not written to the tiers because the write queue was full.",
        labels=["model_name"],
    )
    dropped.add_metric(labels, stats.kv_tiers[0].dropped_writes)
    yield dropped


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.request_success = _TwinCounter(
            "request_success", "Finished requests, by finish reason.", self
        )
        self.time_to_first_token = _TwinHistogram(
            "time_to_first_token_seconds", "Time to the first token.", self
        )
        self.inter_token_latency = _TwinHistogram(
            "inter_token_latency_seconds", "Time between output tokens.", self
        )
        self.e2e_request_latency = _TwinHistogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", self
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TwinHistogram:
    """A latency histogram under both names (vLLM's labels on `vllm:`), its series there, at
    zero, from the first scrape."""

    def __init__(self, name: str, doc: str, metrics: ServerMetrics) -> None:
        vllm = Histogram(
            f"vllm:{name}",
            doc,
            ["model_name", "engine"],
            buckets=LATENCY_BUCKETS,
            registry=metrics.registry,
        )
        ours = Histogram(
            f"blockserve:{name}",
            doc,
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=metrics.registry,
        )
        self.series = (
            vllm.labels(metrics.model_name, VLLM_ENGINE),
            ours.labels(metrics.model_name),
        )

    def observe(self, seconds: float, times: int = 1) -> None:
        for _ in range(times):
            for series in self.series:
                series.observe(seconds)


class _TwinCounter:
    """Finished requests by reason under both names (vLLM's labels on `vllm:`): a series per
    vLLM finish reason, at zero, from the first scrape (as vLLM creates them)."""

    def __init__(self, name: str, doc: str, metrics: ServerMetrics) -> None:
        self.model_name = metrics.model_name
        self.vllm = Counter(
            f"vllm:{name}",
            doc,
            ["model_name", "engine", "finished_reason"],
            registry=metrics.registry,
        )
        self.ours = Counter(
            f"blockserve:{name}", doc, ["model_name", "finished_reason"], registry=metrics.registry
        )
        for reason in FINISH_REASONS:
            self.vllm.labels(self.model_name, VLLM_ENGINE, reason)
            self.ours.labels(self.model_name, reason)

    def inc(self, reason: str, amount: int = 1) -> None:
        self.vllm.labels(self.model_name, VLLM_ENGINE, reason).inc(amount)
        self.ours.labels(self.model_name, reason).inc(amount)


@dataclass
class RequestTimer:
    """Observes one engine request's latencies as its outputs arrive at the server (one per
    prompt: TTFT, ITL and e2e count prompts; `request_success` counts its choices)."""

    metrics: ServerMetrics
    start: float
    last: float | None = None
    num_tokens: int = 0
    finished: bool = False

    def on_output(self, num_tokens: int) -> None:
        now = time.monotonic()
        if self.last is None and num_tokens > 0:
            self.metrics.time_to_first_token.observe(now - self.start)
        elif self.last is not None and num_tokens > self.num_tokens:
            new_tokens = num_tokens - self.num_tokens
            self.metrics.inter_token_latency.observe((now - self.last) / new_tokens, new_tokens)
        if num_tokens > self.num_tokens:
            self.last, self.num_tokens = now, num_tokens

    def on_finish(self, finish_reasons: list[str]) -> None:
        """The engine finished the request: e2e once, and one success per choice."""
        self.finished = True
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.start)
        for reason in finish_reasons:
            self.metrics.request_success.inc(reason)

    def on_abort(self, num_choices: int) -> None:
        """The server aborted it unfinished (the client left, or the drain deadline): its
        choices count as `abort`; no e2e latency (it was not served to the end)."""
        self.finished = True
        self.metrics.request_success.inc("abort", num_choices)


def format_stats_line(previous: EngineStats, current: EngineStats, seconds: float) -> str:
    """vLLM-style throughput line over the last interval."""
    prompt_rate = (current.num_prompt_tokens - previous.num_prompt_tokens) / seconds
    generation_rate = (current.num_generation_tokens - previous.num_generation_tokens) / seconds
    queries = current.prefix_cache_queries - previous.prefix_cache_queries
    hits = current.prefix_cache_hits - previous.prefix_cache_hits
    hit_rate = 100.0 * hits / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
        f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, Waiting: {current.num_waiting} reqs, "
        f"KV cache usage: {100.0 * current.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {hit_rate:.1f}%"
    )


async def log_stats_periodically(engine: EngineClient, interval: float) -> None:
    """Log the stats line every `interval` seconds while anything happened in it."""
    previous, last_time = engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        current, now = engine.stats(), time.monotonic()
        if current != previous or current.num_running or current.num_waiting:
            logger.info(format_stats_line(previous, current, now - last_time))
        previous, last_time = current, now
