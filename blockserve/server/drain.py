"""Draining on SIGTERM: refuse new work at once, let running requests finish until a deadline,
then end what is left with an error its client can read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from blockserve.server.errors import error_response

logger = logging.getLogger(__name__)

GRACE_AFTER_DEADLINE_S = 5.0  # for expired streams to send their error event and close
RETRY_AFTER_S = "5"  # what a draining server tells new clients: try again (elsewhere) soon


class Expirable(Protocol):
    def expire(self) -> None:
        """End now with the shutdown error."""


class Drain:
    """The server's shutdown state; all methods run on the event loop.

    `Drain` counts the runs in flight (server/http_run.py registers each) and holds two flags:
    whether a drain has begun (new requests and /health answer 503 from then on) and whether its
    deadline has passed (running requests then end with a 503 error: an SSE error event, or a
    JSON body).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.expired = asyncio.Event()
        self._running: set[Expirable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def run_started(self, run: Expirable) -> None:
        self._running.add(run)
        self._idle.clear()

    def run_ended(self, run: Expirable) -> None:
        self._running.discard(run)
        if not self._running:
            self._idle.set()

    async def drain(self) -> None:
        """Refuse new work, wait for running requests up to the timeout, then expire the rest
        and give them a moment to send their error."""
        self.draining = True
        logger.info("draining: %d requests running, up to %.0f s", self.num_running, self.timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
            return
        except TimeoutError:
            logger.info("drain deadline: ending %d requests with an error", self.num_running)
        self.expired.set()
        for run in list(self._running):
            run.expire()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), GRACE_AFTER_DEADLINE_S)


class RefuseWhileDraining:
    """ASGI middleware: from SIGTERM on, every new request but /health gets 503 with
    Retry-After (/health answers 503 itself). Pure ASGI, so handlers still see disconnects."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.draining and scope["path"] != "/health":
            response = error_response(
                503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S}
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
