"""Request-body limits: a body larger than `--max-request-body-bytes` is refused with 413
before it is read, whether it declares its length or streams it in chunks; a body whose next
chunk does not come within `--body-timeout` is refused with 408."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockserve.server.errors import error_response


class BodySizeLimit:
    """Wraps an ASGI app; `max_bytes` bounds every HTTP request body, `timeout_s` each wait
    for its next chunk (not the waits after it is whole: a stream's disconnect watch).

    A pure ASGI middleware, so nothing buffers the body before the count: a declared length is
    checked first, a chunked body is counted as it arrives and abandoned at the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0
        whole = False

        async def counted() -> Message:
            nonlocal received, whole
            if whole:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout)",
                ) from None
            if message["type"] == "http.request":
                whole = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the app's body read, as an HTTPException: FastAPI passes
                    # those through its body parsing (others become a 400) to the handlers.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, self._message())
        await response(scope, receive, send)
