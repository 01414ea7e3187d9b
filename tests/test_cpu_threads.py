"""The compute threads: the plan from --cpu-threads and vLLM's variables, the host's load read
from /proc, the count a shared host leaves, the governor that sets it between steps (beside a
real CPU-bound process too), and the front end kept off bound cores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blockserve.cpu_threads import (
    CpuTimes,
    ThreadGovernor,
    ThreadPlan,
    others_cores,
    parse_cpu_list,
    place_front_end,
    plan_threads,
    read_cpu_times,
    threads_left,
)
from blockserve.errors import InvalidConfigError

FOUR = frozenset(range(4))
AFFINITY = frozenset(os.sched_getaffinity(0))


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,6") == frozenset({0, 1, 2, 3, 6})
    assert parse_cpu_list("5") == frozenset({5})
    with pytest.raises(InvalidConfigError) as error:
        parse_cpu_list("0-x")
    assert str(error.value) == (
        "VLLM_CPU_OMP_THREADS_BIND: not a CPU list: '0-x' (expected e.g. 0-3,6)"
    )


@pytest.mark.parametrize(
    ("cpu_threads", "environ", "plan"),
    [
        (None, {}, ThreadPlan(FOUR, 4, adaptive=True)),
        (None, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, ThreadPlan(FOUR, 4, adaptive=True)),
        (3, {"OMP_NUM_THREADS": "1"}, ThreadPlan(FOUR, 3, adaptive=False)),
        (None, {"OMP_NUM_THREADS": "2"}, ThreadPlan(FOUR, 2, adaptive=False)),
        (None, {"OMP_NUM_THREADS": "0"}, ThreadPlan(FOUR, 4, adaptive=True)),
        (
            None,
            {"VLLM_CPU_OMP_THREADS_BIND": "1-2", "OMP_NUM_THREADS": "4"},
            ThreadPlan(frozenset({1, 2}), 2, adaptive=False, bound=True),
        ),
        (
            1,
            {"VLLM_CPU_OMP_THREADS_BIND": "1-2"},
            ThreadPlan(frozenset({1, 2}), 1, adaptive=False, bound=True),
        ),
    ],
)
def test_the_plan(cpu_threads: int | None, environ: dict[str, str], plan: ThreadPlan) -> None:
    assert plan_threads(cpu_threads, environ, FOUR, default_threads=4) == plan


def test_the_adaptive_count_starts_at_torchs_default() -> None:
    """torch's default is one thread per physical core: two logical CPUs each do not double
    it."""
    assert plan_threads(None, {}, FOUR, default_threads=2) == ThreadPlan(FOUR, 2, adaptive=True)


def test_binding_to_cores_the_process_lacks_is_refused() -> None:
    with pytest.raises(InvalidConfigError) as error:
        plan_threads(None, {"VLLM_CPU_OMP_THREADS_BIND": "2-5"}, FOUR, default_threads=4)
    assert str(error.value) == "VLLM_CPU_OMP_THREADS_BIND=2-5 names cores this process may not use"


def test_proc_stat_is_read_for_the_planned_cores(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text(
        "cpu  99 0 99 99 0 0 0 0 0 0\n"
        "cpu0 10 1 5 100 7 2 3 4 0 0\n"
        "cpu1 20 0 10 50 0 0 0 0 0 0\n"
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    (tmp_path / "self" / "stat").write_text(
        "42 (python (x)) S 1 1 1 0 -1 0 0 0 0 0 7 3 0 0 20 0 9 0 1 2 3"
    )
    times = read_cpu_times(frozenset({0, 1}), tmp_path)
    assert times == CpuTimes(busy=(10 + 1 + 5 + 2 + 3 + 4) + (20 + 10), total=132 + 80, own=10)
    assert read_cpu_times(AFFINITY).total > 0  # this host's own


def test_other_processes_cores() -> None:
    before = CpuTimes(busy=100, total=1000, own=50)
    after = CpuTimes(busy=300, total=1200, own=100)  # 200 busy, 50 of them ours, of 200
    assert others_cores(before, after, num_cores=2) == 1.5
    assert others_cores(before, before, num_cores=2) == 0.0


@pytest.mark.parametrize(
    ("others", "threads"), [(0.0, 4), (0.25, 4), (0.3, 3), (1.0, 3), (2.5, 1), (4.0, 1), (9.0, 1)]
)
def test_threads_left_by_the_others(others: float, threads: int) -> None:
    assert threads_left(ThreadPlan(FOUR, 4, adaptive=True), others) == threads


class FakeHost:
    def __init__(self) -> None:
        self.now = 0.0
        self.times = CpuTimes(busy=0, total=0, own=0)
        self.set: list[int] = []

    def advance(self, seconds: float, others: float, own: float) -> None:
        """`seconds` of 2 cores, `others` and `own` of them busy (ticks of 1/100 s)."""
        ticks = round(seconds * 100)
        t = self.times
        self.times = CpuTimes(
            busy=t.busy + round(ticks * (others + own)),
            total=t.total + 2 * ticks,
            own=t.own + round(ticks * own),
        )
        self.now += seconds


def test_the_governor_follows_the_host() -> None:
    host = FakeHost()
    plan = ThreadPlan(frozenset({0, 1}), 2, adaptive=True)
    governor = ThreadGovernor(
        plan, read=lambda cores: host.times, clock=lambda: host.now, set_threads=host.set.append
    )
    governor.before_step()
    assert host.set == [2]
    host.advance(0.2, others=1.0, own=1.0)
    governor.before_step()  # too soon to look
    host.advance(0.4, others=1.0, own=1.0)
    governor.before_step()
    assert (governor.threads, host.set) == (1, [2, 1])
    host.advance(0.6, others=1.5, own=0.5)
    governor.before_step()
    assert host.set == [2, 1]
    host.advance(0.6, others=0.1, own=1.8)  # the other process is gone
    governor.before_step()
    assert (governor.threads, host.set) == (2, [2, 1, 2])


def test_a_fixed_plan_is_never_changed() -> None:
    host = FakeHost()
    governor = ThreadGovernor(
        ThreadPlan(frozenset({0, 1}), 2, adaptive=False),
        read=lambda cores: host.times,
        clock=lambda: host.now,
        set_threads=host.set.append,
    )
    for _ in range(3):
        governor.before_step()
        host.advance(1.0, others=2.0, own=0.0)
    assert host.set == [2]


HOG = "import torch, time\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


@pytest.mark.slow
def test_beside_a_real_cpu_bound_process_the_count_drops() -> None:
    """A process multiplying matrices on every core this one may use: after half a second
    the governor, reading the real /proc, leaves this engine fewer threads than cores."""
    cores = len(AFFINITY)
    env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
    hog = subprocess.Popen([sys.executable, "-c", HOG], env=env)
    try:
        time.sleep(1.0)  # its start-up
        set_to: list[int] = []
        governor = ThreadGovernor(ThreadPlan(AFFINITY, cores, True), set_threads=set_to.append)
        governor.before_step()
        time.sleep(0.8)
        governor.before_step()
    finally:
        hog.kill()
        hog.wait()
    assert set_to[0] == cores
    assert governor.threads < cores or cores == 1
    assert set_to[-1] == governor.threads


@pytest.mark.skipif(len(AFFINITY) < 2, reason="needs two cores: one bound, one for the rest")
def test_bound_threads_and_the_front_end_take_their_own_cores() -> None:
    first = min(AFFINITY)
    bind = {"VLLM_CPU_OMP_THREADS_BIND": str(first)}
    plan = plan_threads(None, bind, AFFINITY, default_threads=len(AFFINITY))
    seen: dict[str, set[int]] = {}

    def engine() -> None:
        ThreadGovernor(plan, set_threads=lambda n: None).before_step()
        seen["engine"] = os.sched_getaffinity(0)

    def front_end() -> None:
        place_front_end(plan, AFFINITY)
        seen["front end"] = os.sched_getaffinity(0)

    for target in (engine, front_end):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen == {"engine": {first}, "front end": set(AFFINITY - {first})}
    assert os.sched_getaffinity(0) == AFFINITY  # this thread's own is untouched
