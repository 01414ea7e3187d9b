"""Metrics: engine gauges and counters read from the client's stats at scrape time, request
latencies observed as outputs arrive, and the periodic stats line."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from blockserve.engine.outputs import EngineStats
from blockserve.server.metrics import RequestTimer, ServerMetrics, format_stats_line

STATS = EngineStats(
    num_running=2,
    num_waiting=1,
    kv_cache_usage=0.25,
    prefix_cache_queries=100,
    prefix_cache_hits=40,
    num_preemptions=3,
    num_prompt_tokens=100,
    num_generation_tokens=50,
)


class StatsOnly:
    """The one part of an EngineClient that metrics read."""

    def __init__(self, stats: EngineStats) -> None:
        self.current = stats

    def stats(self) -> EngineStats:
        return self.current


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_engine_values_are_read_at_scrape_time() -> None:
    """Gauges and counters show the client's current stats, labelled with the model name."""
    client = StatsOnly(STATS)
    metrics = ServerMetrics(client, "m")  # type: ignore[arg-type]
    label = str([("model_name", "m")])
    values = samples(metrics)
    assert values["blockserve:num_requests_running" + label] == 2
    assert values["blockserve:kv_cache_usage_perc" + label] == 0.25
    assert values["blockserve:prefix_cache_hits_total" + label] == 40
    client.current = EngineStats(0, 0, 0.0, 164, 72, 3, 164, 60)
    assert samples(metrics)["blockserve:prefix_cache_queries_total" + label] == 164


def test_every_vllm_series_is_there_at_zero_before_the_first_request() -> None:
    """As vLLM creates its labelled series at start, a dashboard shows zeros, not "no data":
    each latency histogram's count and every finish reason's request_success, under both
    names."""
    values = samples(ServerMetrics(StatsOnly(STATS), "m"))  # type: ignore[arg-type]
    vllm = [("engine", "0"), ("model_name", "m")]
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert values[f"vllm:{name}_seconds_count{vllm}"] == 0
        assert values[f"blockserve:{name}_seconds_count{[('model_name', 'm')]}"] == 0
    for reason in ("stop", "length", "abort", "error", "repetition"):
        labels = sorted([*vllm, ("finished_reason", reason)])
        assert values[f"vllm:request_success_total{labels}"] == 0
        ours = [("finished_reason", reason), ("model_name", "m")]
        assert values[f"blockserve:request_success_total{ours}"] == 0


def test_request_timer_observes_ttft_itl_and_e2e() -> None:
    """First token: one TTFT; three more tokens at once: three ITL samples; finish: e2e and
    one success per choice, by finish reason."""
    metrics = ServerMetrics(StatsOnly(STATS), "m")  # type: ignore[arg-type]
    timer = RequestTimer(metrics, start=0.0)
    timer.on_output(0)
    timer.on_output(1)
    timer.on_output(4)
    timer.on_finish(["length", "stop"])
    values = samples(metrics)
    label = str([("model_name", "m")])
    assert values["blockserve:time_to_first_token_seconds_count" + label] == 1
    assert values["blockserve:inter_token_latency_seconds_count" + label] == 3
    assert values["blockserve:e2e_request_latency_seconds_count" + label] == 1
    reason = "blockserve:request_success_total" + str(
        [("finished_reason", "length"), ("model_name", "m")]
    )
    assert values[reason] == 1


def test_stats_line_rates_over_the_interval() -> None:
    """Throughput and hit rate are for the interval between two snapshots."""
    later = EngineStats(1, 0, 0.5, 200, 90, 3, 300, 70)
    assert format_stats_line(STATS, later, 2.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 50.0%"
    )
