"""Drain: wait for running requests up to the deadline, then expire the ones left."""

from __future__ import annotations

import asyncio

from blockserve.server.drain import Drain


class FakeRun:
    def __init__(self, drain: Drain) -> None:
        self.drain = drain
        self.expired = False

    def expire(self) -> None:
        self.expired = True
        self.drain.run_ended(self)  # as a Run does once its error is out


def test_an_idle_server_drains_at_once() -> None:
    """No run: the drain returns without waiting, nothing expires, new work is refused."""
    drain = Drain(timeout_s=60)
    asyncio.run(asyncio.wait_for(drain.drain(), timeout=5))
    assert drain.draining and not drain.expired.is_set()


def test_runs_that_finish_in_time_are_not_expired() -> None:
    """A run ending before the deadline ends the drain; it is never told to expire."""

    async def main() -> FakeRun:
        drain = Drain(timeout_s=60)
        run = FakeRun(drain)
        drain.run_started(run)
        asyncio.get_running_loop().call_later(0.05, drain.run_ended, run)
        await asyncio.wait_for(drain.drain(), timeout=5)
        assert not drain.expired.is_set()
        return run

    assert asyncio.run(main()).expired is False


def test_runs_past_the_deadline_are_expired() -> None:
    """At the deadline every run still going is expired, and the drain ends once they end."""

    async def main() -> tuple[FakeRun, FakeRun, Drain]:
        drain = Drain(timeout_s=0.05)
        runs = FakeRun(drain), FakeRun(drain)
        for run in runs:
            drain.run_started(run)
        await asyncio.wait_for(drain.drain(), timeout=5)
        return runs[0], runs[1], drain

    first, second, drain = asyncio.run(main())
    assert (first.expired, second.expired, drain.num_running) == (True, True, 0)
