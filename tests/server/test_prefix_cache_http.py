"""Prefix caching seen through HTTP usage: cached_tokens, salts, caching off, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess, read_metric
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module

PROMPT_33 = list(range(100, 133))
METRIC_NAMES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
]


def cached_tokens(url: str, prompt: list[int], **extra: object) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_repeated_prompt_reports_32_cached_tokens(server: ServerProcess) -> None:
    """The same 33-token prompt twice: the second response has cached_tokens == 32."""
    assert cached_tokens(server.url, PROMPT_33) == 0
    assert cached_tokens(server.url, PROMPT_33) == 32


def test_different_cache_salts_do_not_share(server: ServerProcess) -> None:
    """Two salts on the same prompt never hit each other; the same salt does."""
    prompt = list(range(200, 233))
    assert cached_tokens(server.url, prompt, cache_salt="tenant-a") == 0
    assert cached_tokens(server.url, prompt, cache_salt="tenant-b") == 0
    assert cached_tokens(server.url, prompt, cache_salt="tenant-a") == 32


def test_metrics_names_and_prefix_counters(server: ServerProcess) -> None:
    """Every metric of docs/behaviour.md item 33 is exposed; prefix counters rise as predicted."""
    text = httpx.get(f"{server.url}/metrics").text
    for name in METRIC_NAMES:
        assert f"blockserve:{name}" in text, name
    assert 'model_name="' in text
    queries = read_metric(server.url, "prefix_cache_queries_total")
    hits = read_metric(server.url, "prefix_cache_hits_total")
    prompt = list(range(250, 299))  # 49 tokens: 48 hit on the repeat
    cached_tokens(server.url, prompt)
    cached_tokens(server.url, prompt)
    assert read_metric(server.url, "prefix_cache_queries_total") == queries + 98
    assert read_metric(server.url, "prefix_cache_hits_total") == hits + 48
    assert read_metric(server.url, "kv_cache_usage_perc") == 0.0


@pytest.fixture(scope="module")
def server_without_caching(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from tiny_server(tiny_llama_dir, tmp_path_factory, ["--no-enable-prefix-caching"])


def test_no_prefix_caching_reports_zero(server_without_caching: ServerProcess) -> None:
    """With --no-enable-prefix-caching the repeated prompt reports 0 cached tokens."""
    assert cached_tokens(server_without_caching.url, PROMPT_33) == 0
    assert cached_tokens(server_without_caching.url, PROMPT_33) == 0
