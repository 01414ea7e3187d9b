"""`blockserve serve --replicas N`: join (or start) Ray, deploy the application, wait. Ray Serve's
proxy takes the HTTP port (`--host`, `--port`); the application is named "blockserve" and served
at "/". On SIGINT or SIGTERM the application and, when this process started it, the local Ray
instance are shut down."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from blockserve.cluster.config import ClusterConfig
from blockserve.engine.args import EngineArgs
from blockserve.server.options import ServerConfig

logger = logging.getLogger("blockserve")
APP_NAME = "blockserve"


def serve_cluster(
    engine_args: EngineArgs, server_config: ServerConfig, cluster: ClusterConfig
) -> int:
    """Deploy and serve until a signal; the process exit code."""
    import ray
    from ray import serve

    from blockserve.cluster.app import build_application

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    application = build_application(engine_args, server_config, cluster)  # checks first
    ray.init(address=cluster.ray_address, log_to_driver=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info(
            "listening on http://%s:%d (%d replicas, %s router)",
            server_config.host,
            server_config.port,
            cluster.replicas,
            cluster.router,
        )
        stop.wait()
        logger.info("shutting down")
        serve.delete(APP_NAME)
        if cluster.ray_address is None:
            serve.shutdown()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ray.shutdown()
    return 0
