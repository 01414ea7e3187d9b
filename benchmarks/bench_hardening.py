"""Hardening targets, measured against real `blockserve serve` processes (the default model).

big-inputs  a 50 MB body: time to its 413, a tiny completion's latency meanwhile against idle,
            the server's RSS growth; the same for a prompt that fits the body limit and the
            character bound but not the context (tokenized on the worker pool, then refused)
poisoning   4 innocent streams, then each poisoning request of issue 16: statuses, and how
            many innocent streams did not end with their own finish and [DONE]
auth        with --api-key: every route and page, asked without the key, and what answered
sigterm     8 long streams, then SIGTERM with a 1 s drain: how each stream ended, exit code
fuzz        schemathesis over every operation (50 examples per operation and phase):
            test cases per operation, failures, errors

  .venv/bin/python benchmarks/bench_hardening.py --out benchmarks/results/hardening/hardening.json
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import run_sections
from blockserve.bench.server_process import ServerProcess, read_metric
from tests.server.test_fuzz import run_schemathesis

SERVER_ARGS = ["--dtype", "float32"]
TINY = {"prompt": "The capital of France is", "max_tokens": 1}
POISONS = {
    "seed 2**64": {"seed": 2**64},
    "seed 2**64-1, n 2": {"seed": 2**64 - 1, "n": 2},
    "top_k 2**63": {"top_k": 2**63},
    "stop_token_ids [1e9], min_tokens 1": {"stop_token_ids": [10**9], "min_tokens": 1},
    "n 1000": {"n": 1000},
    "max_tokens 1e9": {"max_tokens": 10**9},
}


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"{field} not in /proc/{pid}/status")


def tiny_latency(url: str) -> float:
    start = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=TINY, timeout=300).raise_for_status()
    return time.perf_counter() - start


def send_big(url: str, case: str, repeat: int, context: int) -> list[tuple[int, float]]:
    """In a process of its own (building and sending 50 MB must not hold the measuring
    client's GIL): the big request `repeat` times, each one's status and seconds."""
    content = b'{"prompt": "' + b"word " * (10 << 20) + b'"}'
    if case != "50 MB body":  # under the body limit and the character bound: tokenized, refused
        content = json.dumps({"prompt": "word " * (14 * context)}).encode()
    results = []
    for _ in range(repeat):
        start = time.perf_counter()
        response = httpx.post(
            f"{url}/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=300,
        )
        results.append((response.status_code, round(time.perf_counter() - start, 3)))
    return results


def big_inputs(out_dir: Path, repeat: int = 5) -> dict[str, Any]:
    server = ServerProcess(SERVER_ARGS, out_dir / "big-inputs.log")
    try:
        idle = statistics.median(tiny_latency(server.url) for _ in range(15))
        results: dict[str, Any] = {"idle_tiny_latency_s": round(idle, 4)}
        context = int(httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"])
        with ProcessPoolExecutor(1) as sender:
            for case in ("50 MB body", "prompt of 70 characters per context token"):
                before = rss_mb(server.process.pid)
                sent = sender.submit(send_big, server.url, case, repeat, context)
                latencies = []
                while not sent.done() or not latencies:
                    latencies.append(tiny_latency(server.url))
                results[case] = {
                    "status_and_seconds": sent.result(),
                    "tiny_latency_during_s": {
                        "median": round(statistics.median(latencies), 4),
                        "max": round(max(latencies), 4),
                        "count": len(latencies),
                    },
                    "median_over_idle": round(statistics.median(latencies) / idle, 2),
                    "rss_growth_mb": round(rss_mb(server.process.pid) - before, 1),
                }
        results["peak_rss_mb"] = round(rss_mb(server.process.pid, "VmHWM"), 1)
        return results
    finally:
        server.stop()


def stream_lines(url: str, body: dict[str, Any], sink: list[str]) -> None:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        sink.extend(line for line in r.iter_lines() if line)


def ended_cleanly(lines: list[str]) -> bool:
    """Its last event before [DONE] finished every choice."""
    if len(lines) < 2 or lines[-1] != "data: [DONE]":
        return False
    last = json.loads(lines[-2][len("data: ") :])
    return "choices" in last and all(c["finish_reason"] == "length" for c in last["choices"])


def start_streams(
    url: str, count: int, prefix: str, max_tokens: int
) -> tuple[list[list[str]], list[threading.Thread]]:
    """`count` streams of `max_tokens` tokens each, started and (within a minute) running
    together: the lines each receives, and the threads to join."""
    streams: list[list[str]] = [[] for _ in range(count)]
    body = {"max_tokens": max_tokens, "ignore_eos": True}
    threads = [
        threading.Thread(target=stream_lines, args=(url, {"prompt": f"{prefix} {i}:", **body}, s))
        for i, s in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while read_metric(url, "num_requests_running") < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return streams, threads


def poisoning(out_dir: Path) -> dict[str, Any]:
    server = ServerProcess(SERVER_ARGS, out_dir / "poisoning.log")
    try:
        results: dict[str, Any] = {}
        for name, fields in POISONS.items():
            streams, threads = start_streams(server.url, 4, "Story", max_tokens=64)
            bad = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "x", **fields}, timeout=60
            )
            for thread in threads:
                thread.join(300)
            results[name] = {
                "status": bad.status_code,
                "innocent_affected": sum(not ended_cleanly(s) for s in streams),
            }
        return results
    finally:
        server.stop()


def auth(out_dir: Path) -> dict[str, Any]:
    server = ServerProcess([*SERVER_ARGS, "--api-key", "k1"], out_dir / "auth.log")
    try:
        keyed = {"Authorization": "Bearer k1"}
        paths = httpx.get(f"{server.url}/openapi.json", headers=keyed).json()["paths"]
        asked = [(m.upper(), p) for p, item in paths.items() for m in item]
        asked += [("GET", p) for p in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")]
        answers = {
            f"{m} {p}": httpx.request(m, f"{server.url}{p}", json={}).status_code for m, p in asked
        }
        return {
            "without_key": answers,
            "answered_without_401": sorted(k for k, v in answers.items() if v != 401),
        }
    finally:
        server.stop()


def sigterm(out_dir: Path) -> dict[str, Any]:
    server = ServerProcess([*SERVER_ARGS, "--shutdown-timeout", "1"], out_dir / "sigterm.log")
    try:
        streams, threads = start_streams(server.url, 8, "Tale", max_tokens=2000)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        exit_code = server.process.wait(60)
    finally:
        server.stop()

    def ending(lines: list[str]) -> str:
        if not lines or lines[-1] != "data: [DONE]":
            return "cut"
        last = json.loads(lines[-2][len("data: ") :])
        return "error event" if "error" in last else "finished"

    endings = [ending(s) for s in streams]
    return {
        "streams": 8,
        "endings": {e: endings.count(e) for e in sorted(set(endings))},
        "exit_code": exit_code,
    }


def fuzz(out_dir: Path) -> dict[str, Any]:
    server = ServerProcess([*SERVER_ARGS, "--enable-debug-endpoints"], out_dir / "fuzz.log")
    try:
        report_path = out_dir / "schemathesis.json"
        result = run_schemathesis(server.url, report_path, max_examples=100)
        report = json.loads(report_path.read_text())
    finally:
        server.stop()
    cases = {
        op: sum(n for phase in rates.values() for n in phase.values())
        for op, rates in report["valid_rates"].items()
    }
    return {
        "exit_code": result.returncode,
        "operations": report["operations"]["tested"],
        "test_cases_per_operation": cases,
        "test_cases": report["test_cases"]["generated"],
        "failures": len(report["failures"]),
        "errors": len(report["errors"]),
    }


SECTIONS = {
    "big-inputs": big_inputs,
    "poisoning": poisoning,
    "auth": auth,
    "sigterm": sigterm,
    "fuzz": fuzz,
}


def main() -> None:
    run_sections(__doc__, SECTIONS, "hardening", SERVER_ARGS)


if __name__ == "__main__":
    main()
