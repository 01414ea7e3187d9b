"""`blockserve serve --kv-events-config` publishes; `blockserve events` prints the stream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess, free_port
from tests.server.conftest import TINY_ARGS


@pytest.mark.slow
def test_server_publishes_and_events_cli_prints(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A 33-token completion on the server shows up as one BlockStored line in the CLI."""
    pub_port, replay_port = free_port(), free_port()
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )
    server = ServerProcess(
        ["--model", str(tiny_llama_dir), *TINY_ARGS, "--kv-events-config", config],
        tmp_path / "server.log",
    )
    try:
        prompt = list(range(10, 43))
        body = {"prompt": prompt, "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        # The CLI joins late: the first batch comes back through replay once a live batch
        # reveals the gap.
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "blockserve.cli",
                "events",
                "--json",
                "--max-events",
                "1",
                "--topic",
                "kv",
                "--endpoint",
                f"tcp://127.0.0.1:{pub_port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{replay_port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        other = {"prompt": list(range(100, 120)), "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=other).status_code == 200
        out, err = process.communicate(timeout=60)
    finally:
        assert server.stop() == 0, server.log()
    assert process.returncode == 0, err
    (line,) = out.strip().splitlines()
    record = json.loads(line)
    assert record["seq"] == 0 and record["data_parallel_rank"] == 0
    event = record["event"]
    assert event["type"] == "BlockStored"
    assert (len(event["block_hashes"]), event["parent_block_hash"]) == (2, None)
    assert (event["token_ids"], event["block_size"], event["medium"]) == (prompt[:32], 16, "GPU")


@pytest.mark.slow
def test_events_without_a_publisher_says_what_the_server_needs() -> None:
    """Nothing publishes on the port: after --hint-after seconds the CLI says, once, which
    flag makes a server publish (instead of waiting in silence), and keeps listening."""
    port = free_port()
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "blockserve.cli",
            "events",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
            "--hint-after",
            "0.5",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stderr is not None
        line = cli.stderr.readline()  # the hint ends the silence; bounded by the CLI's own wait
        assert cli.poll() is None  # still listening
    finally:
        cli.kill()
        cli.wait()
    config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
    assert line == (
        f"blockserve events: no KV events from tcp://127.0.0.1:{port} in 0.5 s; a server "
        f"publishes them only when started with --kv-events-config '{config}'. The * makes "
        "the server bind and listen for subscribers; an endpoint naming a host instead makes "
        "its publisher connect to that address (vLLM's rule), where nothing listens unless "
        "a subscriber binds it\n"
    )
