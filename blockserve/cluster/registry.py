"""The blockserve routers running in this process, for `GET /cluster/replicas`. Not in router.py:
Ray Serve ships a custom router's module to each replica by value, so the router's own module
globals are a private copy that code importing `blockserve.cluster.router` never sees. This
module is imported by reference, so the router and the ingress's routes share it."""

from __future__ import annotations

import weakref
from typing import Any, Protocol


class ReportingRouter(Protocol):
    def report(self) -> dict[str, dict[str, Any]]:
        """Per replica the router can route to: what it knows of it."""


ROUTERS: weakref.WeakSet[ReportingRouter] = weakref.WeakSet()


def router_report() -> dict[str, dict[str, Any]] | None:
    """The view of this process's router (None where no blockserve router runs here: Ray's
    own pow2, or a process that holds no handle)."""
    routers = list(ROUTERS)
    return routers[0].report() if len(routers) == 1 else None
