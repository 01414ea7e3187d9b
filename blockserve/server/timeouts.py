"""What uvicorn does not bound: a request's head must arrive within `header_timeout_s` of the
connection's start or its previous response, else the connection closes (a slow body is
server/limits.py's); each connection's kernel send buffer is `SEND_BUFFER_BYTES`, so the writes
to a client that reads nothing stop soon (--stream-write-timeout then ends the stream)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

# The kernel's send buffer of a connection (Linux doubles it): loopback autotuning grows it to
# megabytes, which a stream of tokens for a client that reads nothing would fill for minutes.
SEND_BUFFER_BYTES = 128 << 10


def with_header_deadline(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, as uvicorn's "auto" picks, else
    h11) with the head deadline; pass it as `uvicorn.Config(http=...)`."""
    h11_idle: object = None  # with h11: the head is in once the client's state leaves IDLE
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]

        h11_idle = h11.IDLE

    class HeaderDeadline(Base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state if h11_idle is not None else None  # type: ignore[attr-defined]
            if state is not None and state is not h11_idle:
                self._disarm()

        def on_headers_complete(self) -> None:  # httptools' callback
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
