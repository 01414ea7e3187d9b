"""The app's own routes against a real server: models, tokenize, health, version, the KV
cache report, the metrics' vLLM names (API keys and the response role: test_keyed_server.py)."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import blockserve
from blockserve.bench.server_process import ServerProcess
from blockserve.engine.client import ModelInfo
from blockserve.engine.outputs import EngineStats
from blockserve.platform import probe_host
from blockserve.server.app import build_app
from blockserve.server.options import ServerConfig
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """/v1/models names the model as --model gave it (vLLM's naming), and requests may use
    that name; `created` is when this (module's) server started serving, not 0."""
    (model,) = client.models.list().data
    assert model.id == str(tiny_llama_dir)
    out = client.completions.create(model=model.id, prompt="hi", max_tokens=1)
    assert out.model == model.id
    assert time.time() - 3600 < model.created <= time.time()


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    """/tokenize returns count, max_model_len and tokens; /detokenize inverts it."""
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}).status_code == 400


def test_health_version_and_unknown_route(server: ServerProcess) -> None:
    """/health is 200 with an empty body; /version answers with where the engine runs;
    unknown routes are 404 JSON."""
    health = httpx.get(f"{server.url}/health")
    assert (health.status_code, health.content) == (200, b"")
    version = httpx.get(f"{server.url}/version").json()
    threads = version.pop("threads")  # the server process's own torch threads
    expected = probe_host(torch.device("cpu")).report(torch.float32)  # it runs --dtype float32
    del expected["threads"]
    assert version == {
        "version": blockserve.__version__,
        **expected,
        "cpu_kernels": False,  # the tiny model's head dimension, 16, is not theirs
        "compiled": False,
        "cuda_graphs": 0,
    }
    assert isinstance(threads, int) and threads >= 1
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    embeddings = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}).json()
    message = embeddings["error"]["message"]
    assert message.startswith(
        "POST /v1/embeddings is a vLLM route blockserve does not serve; this server serves "
    )
    assert "POST /v1/chat/completions" in message and "GET /metrics" in message


def test_debug_kv_cache_reports_a_sound_idle_pool(server: ServerProcess) -> None:
    """Between requests: 256 blocks, none held, usage 0, no integrity error."""
    httpx.post(f"{server.url}/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2})
    report = httpx.get(f"{server.url}/debug/kv_cache").json()
    assert report["num_blocks"] == 256 and report["num_cached_hashes"] >= 2
    assert (report["num_requests_holding_blocks"], report["usage"]) == (0, 0.0)
    assert report["integrity_errors"] == []


def test_miss_ratio_curve_on_the_debug_route_and_in_metrics(server: ServerProcess) -> None:
    """After a repeated prompt: 17 increasing sizes whose estimates never fall and end above
    0; /metrics carries the 7 gauges, at 1/8x to 8x the 255-block cache."""
    for _ in range(2):
        body = {"prompt": list(range(60, 100)), "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    report = httpx.get(f"{server.url}/debug/miss_ratio_curve").json()
    capacities = [p["capacity_blocks"] for p in report["points"]]
    rates = [p["estimated_hit_rate"] for p in report["points"]]
    assert (report["num_blocks"], len(capacities)) == (255, 17)
    assert capacities == sorted(set(capacities)) and capacities[-1] == 4080
    assert rates == sorted(rates) and rates[-1] > 0
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    (gauge,) = [f for f in families if f.name == "blockserve:prefix_cache_hit_rate_estimate"]
    gauge_capacities = [int(s.labels["capacity_blocks"]) for s in gauge.samples]
    assert gauge_capacities == [32, 64, 128, 255, 510, 1020, 2040]
    assert all(0 < s.value <= 1 for s in gauge.samples)


class IdleClient:
    """An engine client that is never started: enough to build the app and list its routes."""

    def model_info(self) -> ModelInfo:
        return ModelInfo("m", 64, 100, None)

    def is_healthy(self) -> bool:
        return True


def test_several_served_names() -> None:
    """--served-model-name a b: both are listed, either may be asked for, another is a 404."""
    app = build_app(IdleClient(), ServerConfig(served_model_name=("a", "b")))  # type: ignore[arg-type]
    client = TestClient(app)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]
    missing = client.post("/v1/completions", json={"model": "c", "prompt": "hi"})
    assert (missing.status_code, missing.json()["error"]["message"]) == (
        404,
        "The model `c` does not exist.",
    )


def test_debug_routes_exist_only_when_enabled() -> None:
    """/debug/kv_cache is 404 unless --enable-debug-endpoints (it shows every tenant's load)."""
    closed = build_app(IdleClient(), ServerConfig())  # type: ignore[arg-type]
    missing = TestClient(closed).get("/debug/kv_cache")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, 404)
    opened = build_app(IdleClient(), ServerConfig(enable_debug_endpoints=True))  # type: ignore[arg-type]
    paths = {route.path for route in opened.routes}  # type: ignore[attr-defined]
    assert {"/debug/kv_cache", "/debug/miss_ratio_curve"} <= paths
    assert TestClient(closed).get("/debug/miss_ratio_curve").status_code == 404


ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.32.0's metrics this server exposes, with their types and label names, as
# vllm/v1/metrics/loggers.py defines them (`make peer-vllm` installs it under .peer/).
VLLM_032_METRICS = {
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}),
}


def test_vllm_metric_names_types_and_labels(server: ServerProcess) -> None:
    """Dashboards and routers written for vLLM read these names: each is there with vLLM's
    type and labels, the model's served name and engine "0"; one more request of 3 tokens
    moves both names' counters alike."""
    before = metric_families(server)
    body = {"prompt": list(range(30, 50)), "max_tokens": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    after = metric_families(server)
    exposed = {
        name: (f.type, {label for s in f.samples for label in s.labels if label != "le"})
        for name, f in after.items()
        if name.startswith("vllm:")
    }
    assert exposed == VLLM_032_METRICS
    for prefix in ("vllm", "blockserve"):
        moved = {
            name: value(after, f"{prefix}:{name}") - value(before, f"{prefix}:{name}")
            for name in ("generation_tokens", "request_success", "prompt_tokens")
        }
        assert moved == {"generation_tokens": 3.0, "request_success": 1.0, "prompt_tokens": 20.0}
    # A series per vLLM finish reason, engine "0" (the 3 tokens above ended by length).
    success = [
        (s.labels["engine"], s.labels["finished_reason"])
        for s in after["vllm:request_success"].samples
        if s.name.endswith("_total")
    ]
    assert sorted(success) == [("0", r) for r in ("abort", "error", "length", "repetition", "stop")]


def metric_families(server: ServerProcess) -> dict[str, Metric]:
    """/metrics' families, but prometheus_client's `_created` series."""
    text = httpx.get(f"{server.url}/metrics").text
    return {
        f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")
    }


def value(families: dict[str, Metric], name: str) -> float:
    """A counter's total over its series."""
    return sum(s.value for s in families[name].samples if s.name.endswith("_total"))


def test_the_grafana_dashboard_reads_metrics_the_server_exposes(server: ServerProcess) -> None:
    """docs/grafana/serving-dashboard.json: every series its queries name exists here under
    either prefix (`vllm`, the default, reads a vLLM server too)."""
    dashboard = json.loads((ROOT / "docs" / "grafana" / "serving-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {m for expr in exprs for m in re.findall(r"\$\{prefix\}:(\w+)", expr)}
    assert len(exprs) == 14 and len(named) == 12
    exposed = {
        sample.name
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        for sample in family.samples
    }
    for prefix in ("vllm", "blockserve"):
        assert sorted(f"{prefix}:{m}" for m in named if f"{prefix}:{m}" not in exposed) == []


class StatsClient(IdleClient):
    """An engine client that starts, stops, and always has one request running."""

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(1, 0, 0.5, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("disabled", [False, True])
def test_disable_log_stats_silences_the_stats_line(
    disabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(disable_log_stats=disabled, stats_interval_s=0.01)
    caplog.set_level(logging.INFO, logger="blockserve.stats")
    with TestClient(build_app(StatsClient(), config)):  # type: ignore[arg-type]
        time.sleep(0.2)
    lines = [r.message for r in caplog.records if r.name == "blockserve.stats"]
    assert (lines == []) == disabled
    assert all(line.startswith("Avg prompt throughput") for line in lines)


def test_uvicorn_log_level_reaches_uvicorn(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--uvicorn-log-level warning: the server serves, and uvicorn's info lines are gone."""
    args = ["--uvicorn-log-level", "warning", "--disable-log-requests"]
    for process in tiny_server(tiny_llama_dir, tmp_path_factory, args):
        assert httpx.get(f"{process.url}/health").status_code == 200
        log = process.log_path.read_text()
        assert "Application startup complete" not in log
        assert "loading the model" in log  # blockserve's own info lines stay
