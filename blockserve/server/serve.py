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

from blockserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from blockserve.engine.async_engine import AsyncEngine
from blockserve.engine.llm_engine import LLMEngine
from blockserve.events.config import KVEventsConfig
from blockserve.server.app import build_app

logger = logging.getLogger("blockserve")
GRACEFUL_SHUTDOWN_S = 5


def serve(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    server_config: ServerConfig,
    kv_events_config: KVEventsConfig | None = None,
) -> int:
    """Serve until interrupted; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = LLMEngine(model_config, cache_config, scheduler_config, kv_events_config)
    runner = engine.runner
    model_name = server_config.served_model_name or engine.model_name
    num_tokens = runner.num_blocks * cache_config.block_size
    logger.info(
        "model %s (%s, dtype %s), context %d tokens",
        model_name,
        runner.loaded.model_dir,
        str(runner.loaded.dtype).removeprefix("torch."),
        engine.max_model_len,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens; prefix caching %s (%s)",
        runner.num_blocks,
        cache_config.block_size,
        num_tokens,
        "on" if cache_config.enable_prefix_caching else "off",
        cache_config.prefix_caching_hash_algo,
    )
    app = build_app(AsyncEngine(engine), server_config)
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
