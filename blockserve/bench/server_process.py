"""A real `blockserve serve` (or another server's CLI) in a subprocess on 127.0.0.1 and a free
port, ready once /health answers: for `blockserve bench serve`, the benchmarks and the tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def read_metric(url: str, name: str) -> float:
    """The value of `blockserve:<name>` (its first series) from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^blockserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise LookupError(f"{name} is not in /metrics")
    return float(match.group(1))


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (with the prefix: `vllm:...`) in /metrics whose
    labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """Starts the CLI (`python -m module subcommand`) in a subprocess, waits for /health,
    stops it with SIGINT. The benchmarks start vLLM's API server the same way (from .peer/)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        module: str = "blockserve.cli",
        python: str = sys.executable,
        subcommand: str | None = "serve",
        ready_timeout: float = 120,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [python, "-m", module, *([subcommand] if subcommand else [])]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self._wait_healthy(timeout=ready_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy in {timeout}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 30) -> int:
        """SIGINT, then wait: returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def wait_for_line(self, texts: tuple[str, ...], timeout: float) -> str | None:
        """Until a line of the server's log holds one of `texts`: that text; None at `timeout`
        or once the server has exited."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log_path.read_text(errors="replace")
            if (seen := next((text for text in texts if text in log), None)) is not None:
                return seen
            if time.monotonic() > deadline or self.process.poll() is not None:
                return None
            time.sleep(0.5)

    def wait_for_cluster(self, replicas: int, timeout: float, ours: bool = True) -> bool:
        """For `serve --replicas N`: until the CLI says Serve runs the application and the
        ingress's router can reach all `replicas` (Serve reports the application running
        before every handle has heard of every replica). `ours`: a blockserve router (every
        --router but pow2), which the ingress reports only once Serve has created it; with
        Ray's own (pow2) there is no report to wait for. False at `timeout`."""
        deadline = time.monotonic() + timeout
        if self.wait_for_line(("listening on http://",), timeout) is None:
            return False
        while True:
            router = httpx.get(f"{self.url}/cluster/replicas").json()["router"]
            if (router is None and not ours) or (router is not None and len(router) == replicas):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
