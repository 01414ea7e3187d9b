"""`blockserve serve` as a process: what it logs at start, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess, read_metric
from tests.server.conftest import TINY_ARGS


@pytest.mark.slow
def test_start_up_log_and_sigterm_exit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The log names the model, the cache and the address; SIGTERM ends with code 0."""
    server = ServerProcess(["--model", str(tiny_llama_dir), *TINY_ARGS], tmp_path / "log")
    try:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    log = server.log()
    assert f"model {tiny_llama_dir.name} ({tiny_llama_dir}, dtype float32), context 512" in log
    assert "KV cache: 256 blocks of 16 tokens = 4096 tokens; prefix caching on (sha256)" in log
    assert f"listening on http://127.0.0.1:{server.port}" in log
    assert "stopped" in log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs (--max-num-seqs) must be positive, got 0"),
        (["--device", "tpu"], "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ],
)
def test_a_bad_engine_flag_exits_2_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is reported with its flag and the exit code is 2; no model is loaded."""
    from blockserve.cli import main

    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert capsys.readouterr().err == f"blockserve serve: {message}\n"


@pytest.mark.slow
def test_sigterm_drains_running_streams_and_refuses_new_work(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """8 long streams, then SIGTERM (1 s drain): /health and a new request answer 503 at
    once (with Retry-After); every stream ends with [DONE], after its last chunk or a 503
    error event; the process exits 0."""
    args = ["--model", str(tiny_llama_dir), *TINY_ARGS, "--shutdown-timeout", "1"]
    server = ServerProcess(args, tmp_path / "log")
    streams: list[list[str]] = [[] for _ in range(8)]

    def stream(i: int) -> None:
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            streams[i].extend(line for line in r.iter_lines() if line)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while read_metric(server.url, "num_requests_running") < 8:
            assert time.monotonic() < deadline, "the 8 streams never ran together"
            time.sleep(0.02)
        server.process.send_signal(signal.SIGTERM)
        assert httpx.get(f"{server.url}/health").status_code == 503
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "5")
        assert refused.json()["error"]["message"] == "the server is shutting down"
        for thread in threads:
            thread.join(30)
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        finished = "choices" in last and last["choices"][0]["finish_reason"] == "length"
        assert finished or last["error"]["code"] == 503


@pytest.mark.slow
def test_a_dead_engine_means_503s_and_exit_code_1(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The engine loop dies at its first step: that request gets a 503 naming only the
    error's type, /health and the next request answer 503, and after SIGTERM the process
    exits 1 so an orchestrator sees a failure, not a clean stop."""
    args = ["--model", str(tiny_llama_dir), *TINY_ARGS]
    server = ServerProcess(args, tmp_path / "log", module="tests.server.broken_engine")
    try:
        first = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert first.status_code == 503
        assert first.json()["error"]["message"] == (
            "the engine loop died (RuntimeError); the server log has details"
        )
        assert httpx.get(f"{server.url}/health").status_code == 503
        second = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert (second.status_code, second.json()["error"]["message"]) == (
            503,
            "the engine is not running",
        )
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 1
    finally:
        server.stop()
    assert "stopped: the engine had died" in server.log()


@pytest.mark.slow
def test_a_taken_port_fails_before_the_model_loads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The port is bound first: a taken one is exit 2 with one line, and nothing was loaded
    (no model line in the log, no 'listening')."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "blockserve.cli", "serve", "--model", str(tiny_llama_dir)]
        result = subprocess.run(
            [*command, *TINY_ARGS, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"blockserve serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "model " not in result.stderr and "listening" not in result.stderr
