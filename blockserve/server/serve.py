"""Running the server: build the engine, print where it listens, serve until a signal.

uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight requests finish for a few
seconds, cancels the rest (which aborts them in the engine), then the app's lifespan stops the
engine thread and the event publisher.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from blockserve.config import EngineConfig, ServerConfig
from blockserve.engine.async_engine import AsyncEngine
from blockserve.server.app import build_app

logger = logging.getLogger("blockserve")
GRACEFUL_SHUTDOWN_S = 5


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until interrupted; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_app(AsyncEngine.from_config(engine_config), server_config)
    kv_events_config = engine_config.kv_events
    if kv_events_config is not None and kv_events_config.enabled:
        logger.info(
            "publishing KV events on %s (replay: %s)",
            kv_events_config.endpoint,
            kv_events_config.replay_endpoint,
        )
    logger.info("listening on http://%s:%d", server_config.host, server_config.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the
    # handler found at start: turn both into KeyboardInterrupt, which ends here, cleanly.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run()
    except KeyboardInterrupt:
        logger.info("stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
