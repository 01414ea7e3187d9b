"""Async scheduling's pipeline: each step runs on one worker thread while the engine thread
applies the previous step's outputs and schedules the next; results come back in step order."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Step = TypeVar("Step")
Result = TypeVar("Result")


class StepPipeline(Generic[Step, Result]):
    """One step in flight at a time beside the engine thread. `submit` starts a step and
    returns the one before it with its result (None for the first); `drain` waits for the
    step in flight. Steps run one after another on the worker, so a step sees every earlier
    step's effects (its sampled tokens, its K/V writes) and none of a later one's."""

    def __init__(
        self, run: Callable[[Step], Result], bind_thread: Callable[[], None] | None = None
    ) -> None:
        """`bind_thread` prepares the worker thread (the runner's device made current)."""
        self._run = run
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="blockserve-step", initializer=bind_thread
        )
        self._in_flight: tuple[Step, Future[Result]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def submit(self, step: Step) -> tuple[Step, Result] | None:
        previous = self._in_flight
        self._in_flight = (step, self._worker.submit(self._run, step))
        return None if previous is None else (previous[0], previous[1].result())

    def drain(self) -> tuple[Step, Result] | None:
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else (previous[0], previous[1].result())

    def shutdown(self) -> None:
        self.drain()
        self._worker.shutdown(wait=True)
