"""64 concurrent streaming clients, 10 of which hang up mid-stream, against a real server."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess, read_metric
from tests.server.conftest import tiny_server

NUM_CLIENTS = 64
NUM_DISCONNECTS = 10
NUM_PROMPTS = 16
MAX_TOKENS = 12


def prompt(i: int) -> list[int]:
    """16 distinct prompts sharing a 32-token opening, so the load also exercises hits."""
    return list(range(40, 72)) + [(7 * i + j) % 300 for j in range(9)]


def body(i: int, stream: bool) -> dict[str, object]:
    return {
        "prompt": prompt(i % NUM_PROMPTS),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def stream_text(client: httpx.AsyncClient, url: str, i: int, hang_up: bool) -> str | None:
    """The streamed text, or None after hanging up on purpose after two chunks."""
    text, chunks = "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body(i, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if hang_up and chunks == 2:
                return None  # leaving the block closes the connection mid-stream
    return text


@pytest.mark.slow
def test_concurrent_streams_with_disconnects_leave_a_clean_pool(server: ServerProcess) -> None:
    """Completed streams carry the right text; aborted ones free their blocks; pool is sound."""
    expected = [
        httpx.post(f"{server.url}/v1/completions", json=body(i, False), timeout=60).json()[
            "choices"
        ][0]["text"]
        for i in range(NUM_PROMPTS)
    ]

    async def load() -> list[str | None]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(
                    stream_text(client, server.url, i, i < NUM_DISCONNECTS)
                    for i in range(NUM_CLIENTS)
                )
            )

    texts = asyncio.run(load())
    assert texts[:NUM_DISCONNECTS] == [None] * NUM_DISCONNECTS
    for i in range(NUM_DISCONNECTS, NUM_CLIENTS):
        assert texts[i] == expected[i % NUM_PROMPTS], i

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        report = httpx.get(f"{server.url}/debug/kv_cache").json()
        if report["num_requests_holding_blocks"] == 0:
            break
        time.sleep(0.05)
    assert report["num_requests_holding_blocks"] == 0
    assert report["usage"] == 0.0
    assert report["integrity_errors"] == []
    assert read_metric(server.url, "kv_cache_usage_perc") == 0.0
    assert read_metric(server.url, "num_requests_running") == 0.0
    # The server still answers.
    again = httpx.post(f"{server.url}/v1/completions", json=body(0, False), timeout=60)
    assert again.json()["choices"][0]["text"] == expected[0]


@pytest.fixture(scope="module")
def server_with_key(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server behind an API key (metrics left open to count tokens)."""
    yield from tiny_server(
        tiny_llama_dir, tmp_path_factory, ["--api-key", "k", "--metrics-without-auth"]
    )


def holding_blocks(server: ServerProcess, headers: dict[str, str]) -> int:
    report = httpx.get(f"{server.url}/debug/kv_cache", headers=headers).json()
    return int(report["num_requests_holding_blocks"])


def wait_for_holders(
    server: ServerProcess, count: int, headers: dict[str, str], timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while holding_blocks(server, headers) != count:
        assert time.monotonic() < deadline, f"never {count} requests holding blocks"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["server", "server_with_key"])
def test_non_streaming_client_that_leaves_aborts_its_request(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """A non-streaming client that hangs up once its request runs stops it: its blocks are
    freed and fewer tokens than asked are generated — behind an API key too (a middleware
    must not hide the disconnect from the handler)."""
    server: ServerProcess = request.getfixturevalue(fixture)
    headers = {"Authorization": "Bearer k"} if fixture == "server_with_key" else {}
    before = read_metric(server.url, "generation_tokens_total")
    payload = json.dumps(
        {"prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    ).encode()
    header_lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"{header_lines}Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for_holders(server, 1, headers)  # running: now hang up, without reading the answer
    wait_for_holders(server, 0, headers)
    generated = read_metric(server.url, "generation_tokens_total") - before
    assert 0 < generated < 500
