"""Scheduling: requests, their queues and the continuous-batching scheduler. Imports no torch."""

from __future__ import annotations

from blockserve.sched.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus"]
