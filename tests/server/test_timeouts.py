"""The head deadline with either of uvicorn's HTTP parsers (server/timeouts.py): httptools,
which the server runs where it is installed, and h11, its fallback. A real uvicorn server on
loopback; a connection that sends nothing, or half a request line, is closed at the deadline,
and a whole request is answered."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockserve.bench.server_process import free_port
from blockserve.server.timeouts import with_header_deadline
from tests.server.test_hostile_requests import read_until_closed

DEADLINE_S = 0.5


async def app(scope: dict, receive: object, send: object) -> None:  # a bare ASGI app
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


@pytest.fixture(params=["httptools", "h11"])
def port(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    if request.param == "h11":  # as where httptools is not installed
        monkeypatch.setitem(sys.modules, "uvicorn.protocols.http.httptools_impl", None)
    protocol = with_header_deadline(DEADLINE_S)
    assert issubclass(protocol, H11Protocol) == (request.param == "h11")
    number = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=number, http=protocol, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield number
    server.should_exit = True
    thread.join(10)


def closed_after(port: int, opening: bytes) -> tuple[bytes, float]:
    """What the server sent and when it closed (at most 10 s)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(opening)
        return read_until_closed(sock, 10)


@pytest.mark.slow
def test_a_silent_or_half_sent_head_is_closed_at_the_deadline(port: int) -> None:
    """Nothing, or half a request line: closed, nothing sent, at the 0.5 s deadline."""
    for opening in (b"", b"GET /hea"):
        data, seconds = closed_after(port, opening)
        assert data == b""
        assert DEADLINE_S * 0.8 <= seconds < 8  # the deadline, not at once and not never


def test_a_whole_request_is_answered(port: int) -> None:
    """A request with its head in time gets its answer."""
    data, _ = closed_after(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"ok")
