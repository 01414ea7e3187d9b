"""What one client must not do to the server or to other clients, tried on a real server over
real sockets: crash it with a constraint, receive another client's output through a shared
request_id, ask for unbounded work, or hold connections open without sending a request."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess, metric_sum
from tests.hostile_inputs import lark_chain, ref_chain
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module

NUM_RACES = 24


@pytest.fixture(scope="module")
def hardened(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Deadlines of 1 s for a request's head and for each chunk of its body."""
    yield from tiny_server(
        tiny_llama_dir, tmp_path_factory, ["--header-timeout", "1", "--body-timeout", "1"]
    )


def completion(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"max_tokens": 4, **body}, timeout=60)


def test_a_label_reused_the_moment_its_stream_hangs_up_gets_its_own_output(
    hardened: ServerProcess,
) -> None:
    """A streams under request_id "same", reads one chunk and hangs up; B sends "same" at once
    (within milliseconds), NUM_RACES times: B always gets its own greedy text under its
    label, never A's."""
    url = hardened.url
    mine = {"prompt": list(range(200, 211)), "temperature": 0, "ignore_eos": True}
    expected = completion(url, **mine).json()["choices"][0]["text"]
    theirs = {"prompt": list(range(11)), "max_tokens": 64, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        for _ in range(NUM_RACES):
            body = {**theirs, "request_id": "same"}
            with client.stream("POST", f"{url}/v1/completions", json=body) as stream:
                next(line for line in stream.iter_lines() if line.startswith("data: "))
            answer = completion(url, request_id="same", **mine).json()
            assert (answer["id"], answer["choices"][0]["text"]) == ("same", expected)


def test_a_label_in_use_by_a_live_stream_is_no_error(hardened: ServerProcess) -> None:
    """While A's "busy" streams, B's "busy" runs too: nothing tells B the label is taken."""
    url = hardened.url
    with httpx.Client(timeout=60) as client:
        live = {"prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True}
        with client.stream("POST", f"{url}/v1/completions", json={**live, "request_id": "busy"}):
            answer = completion(url, prompt=[8, 9], request_id="busy")
            assert (answer.status_code, answer.json()["id"]) == (200, "busy")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"structured_outputs": {"grammar": lark_chain(3000)}}, "--structured-outputs-max-rules"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": ref_chain(1001)},
                }
            },
            "--structured-outputs-max-rules",
        ),
        ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "max-bytes"),
    ],
    ids=["lark-3000-rules", "ref-chain-1001", "choice-100k"],
)
def test_constraints_that_took_a_server_down_are_400s(
    hardened: ServerProcess, body: dict[str, Any], words: str
) -> None:
    """Each is a 400 naming structured_outputs and its limit; the server answers on."""
    response = completion(hardened.url, prompt="hi", **body)
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "structured_outputs"
    assert httpx.get(f"{hardened.url}/health", timeout=10).status_code == 200


def test_a_named_tool_over_the_limits_is_a_400_and_at_the_limit_runs(
    hardened: ServerProcess,
) -> None:
    """A tool whose parameters chain 1,001 $refs is refused; 1,000 (the limit) compile, off
    the engine thread, and the call comes back."""

    def call(depth: int) -> httpx.Response:
        tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(depth)}}
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "max_tokens": 8,
        }
        return httpx.post(f"{hardened.url}/v1/chat/completions", json=body, timeout=60)

    refused = call(1001)
    assert refused.status_code == 400
    assert "--structured-outputs-max-rules" in refused.json()["error"]["message"]
    assert call(1000).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "flag"),
    [
        ({"prompt": [[1, 2]] * 2049}, "prompt", "--max-prompts-per-request"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-strings"),
        ({"prompt": "hi", "stop": ["x" * 4097]}, "stop", "--max-stop-chars"),
        (
            {"prompt": [[1, 2]] * 8, "n": 128, "max_tokens": 300},
            "max_tokens",
            "--max-request-tokens",
        ),
        (  # 16 x 128 x 1 generated, but 16 x 200 x 128 prompt tokens scored: each counts
            {"prompt": [[1] * 200] * 16, "n": 128, "max_tokens": 1, "echo": True, "logprobs": 1},
            "prompt_logprobs",
            "--max-request-tokens",
        ),
    ],
    ids=["2049-prompts", "65-stop-strings", "4097-stop-chars", "8x128x300-tokens", "scored-x-n"],
)
def test_work_past_a_limit_is_a_400_naming_it(
    hardened: ServerProcess, body: dict[str, Any], param: str, flag: str
) -> None:
    """Refused before anything is queued, naming the field and the flag."""
    response = completion(hardened.url, **body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert flag in response.json()["error"]["message"]


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took (at most
    `limit_s`: a server that never closes fails the caller's assertion)."""
    sock.settimeout(limit_s)
    start, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        pass
    return data, time.monotonic() - start


def test_a_connection_that_sends_no_request_is_closed(hardened: ServerProcess) -> None:
    """Nothing sent, or half a request line: closed after the 1 s head deadline, not held."""
    for opening in (b"", b"GET /hea"):
        with socket.create_connection(("127.0.0.1", hardened.port)) as sock:
            sock.sendall(opening)
            data, seconds = read_until_closed(sock, 15)
        assert data == b""
        assert 0.9 <= seconds < 10  # the 1 s deadline, not at once and not never


def test_a_body_that_stops_arriving_is_a_408(hardened: ServerProcess) -> None:
    """Headers promise 100 bytes, 10 come: a 408 after the 1 s body deadline."""
    with socket.create_connection(("127.0.0.1", hardened.port)) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt":')
        data, _ = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408 ")
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert "--body-timeout" in body["error"]["message"]


ABORTED = "vllm:request_success_total"


def test_a_stream_whose_client_reads_nothing_is_aborted(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A client asks for 32 x 500 streamed tokens with 20 logprobs each (some 20 MB of
    events) and reads nothing. Once the socket's buffers are full, a write waits; after
    --stream-write-timeout 1 s the request is aborted (its 32 choices counted as aborts, its
    blocks freed: nothing running) and the connection closed before the stream's end."""
    for server in tiny_server(tiny_llama_dir, tmp_path_factory, ["--stream-write-timeout", "1"]):
        body = json.dumps({"prompt": "hi", "stream": True, "n": 32, "max_tokens": 500,
                           "logprobs": 20, "ignore_eos": True}).encode()  # fmt: skip
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 120
        while metric_sum(server.url, ABORTED, finished_reason="abort") < 32:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        data, _ = read_until_closed(sock, 30)
        sock.close()
        assert b"data: [DONE]" not in data and data.startswith(b"HTTP/1.1 200 ")
        # The gauge is the engine's count at its last step boundary: the aborts are counted
        # at once, the running requests they freed leave the gauge at the next boundary.
        while metric_sum(server.url, "vllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the aborted samples kept running"
            time.sleep(0.2)
        assert completion(server.url, prompt="hi", max_tokens=2).status_code == 200
