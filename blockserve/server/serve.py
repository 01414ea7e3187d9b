"""Running the server: bind the port, build the engine, serve until a signal. The port is bound
before the model loads, so a taken port fails at once (exit 2, one line); uvicorn logs "Uvicorn
running on ..." when it really accepts connections."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from types import FrameType

import uvicorn

from blockserve.config import EngineConfig
from blockserve.cpu_threads import host_thread_plan, place_front_end
from blockserve.engine.async_engine import AsyncEngine
from blockserve.errors import InvalidConfigError
from blockserve.server.app import build_app
from blockserve.server.drain import Drain
from blockserve.server.options import ServerConfig
from blockserve.server.timeouts import with_header_deadline

logger = logging.getLogger("blockserve")
GRACEFUL_SHUTDOWN_S = 5


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until interrupted; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not server_config.served_model_name and engine_config.model.model is not None:
        # vLLM's naming: the model is served under the string it was given.
        served = (engine_config.model.model,)
        server_config = dataclasses.replace(server_config, served_model_name=served)
    listening = bind_socket(server_config.host, server_config.port)
    logger.info("bound %s:%d; loading the model", server_config.host, server_config.port)
    try:
        return _serve_on(listening, engine_config, server_config)
    finally:
        listening.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now; InvalidConfigError (one line) when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _serve_on(
    listening: socket.socket, engine_config: EngineConfig, server_config: ServerConfig
) -> int:
    affinity = frozenset(os.sched_getaffinity(0))  # the event loop and the tokenizers' threads
    runtime = engine_config.runtime
    if runtime.threads is None:  # planned once, for the front end and the engine
        runtime = dataclasses.replace(runtime, threads=host_thread_plan(runtime.cpu_threads))
        engine_config = dataclasses.replace(engine_config, runtime=runtime)
    assert runtime.threads is not None
    place_front_end(runtime.threads, affinity)
    engine = AsyncEngine.from_config(engine_config, server_config.tokenizer_workers)
    app = build_app(engine, server_config)
    server = DrainingServer(
        app.state.drain,
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.uvicorn_log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            http=with_header_deadline(server_config.header_timeout),
            timeout_keep_alive=server_config.timeout_keep_alive,
        ),
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the
    # handler found at start: turn both into KeyboardInterrupt, which ends here, cleanly.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:
        pass  # the signal that ended a graceful shutdown, raised again by uvicorn
    finally:
        signal.signal(signal.SIGTERM, previous)
    if engine.dead_error is not None:  # an orchestrator should see a failure, not a stop
        logger.error("stopped: the engine had died")
        return 1
    logger.info("stopped")
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before the shutdown that the first SIGTERM starts.

    SIGTERM drains first (server/drain.py): /health and new requests answer 503 while running
    requests get up to `--shutdown-timeout` to finish, then what is left ends with an error;
    only then does uvicorn shut down. SIGINT (or a second SIGTERM) is uvicorn's own: stop
    accepting, let in-flight requests finish for a few seconds, cancel the rest (which aborts
    them in the engine). Either way the app's lifespan then stops the engine thread and the
    event publisher.
    """

    def __init__(self, drain: Drain, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the app started and the socket accepts: only now is it true
            logger.info("listening on http://%s:%d", self.config.host, self.config.port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and self._loop is not None:
            self.drain.draining = True  # at once: /health turns 503 before the next request
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.drain.drain()
        self.should_exit = True
