"""The compute threads of a CPU engine: how many (--cpu-threads, VLLM_CPU_OMP_THREADS_BIND,
OMP_NUM_THREADS, else adapted between steps to the cores other processes leave it), on which
cores, and the HTTP front end's cores beside them."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from blockserve.errors import InvalidConfigError

logger = logging.getLogger(__name__)

SAMPLE_S = 0.5  # how often the adaptive count looks at the host
OTHERS_SLACK = 0.25  # cores of other processes' use (daemons, shells) that cost no thread


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """`threads` compute threads on `cores`; `adaptive`: fewer while other processes use the
    cores (never more than `threads`)."""

    cores: frozenset[int]
    threads: int
    adaptive: bool
    bound: bool = False  # the engine thread (and its OpenMP team) kept on `cores`


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-3,6`: the kernel's CPU-list syntax, as VLLM_CPU_OMP_THREADS_BIND takes it."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise InvalidConfigError(
                f"VLLM_CPU_OMP_THREADS_BIND: not a CPU list: {text!r} (expected e.g. 0-3,6)"
            )
        cores.update(range(int(first), int(last or first) + 1))
    return frozenset(cores)


def plan_threads(
    cpu_threads: int | None,
    environ: Mapping[str, str],
    affinity: frozenset[int],
    default_threads: int,
) -> ThreadPlan:
    """--cpu-threads N: N threads; VLLM_CPU_OMP_THREADS_BIND=LIST: one per listed core, kept
    there; OMP_NUM_THREADS: as many; else adaptive, up to torch's default (one per physical
    core) within the cores this process may use."""
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if bind not in ("auto", "all", "nobind", ""):
        cores = parse_cpu_list(bind)
        if not cores <= affinity:
            raise InvalidConfigError(
                f"VLLM_CPU_OMP_THREADS_BIND={bind} names cores this process may not use"
            )
        return ThreadPlan(cores, cpu_threads or len(cores), adaptive=False, bound=True)
    if cpu_threads is not None:
        return ThreadPlan(affinity, cpu_threads, adaptive=False)
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadPlan(affinity, int(omp), adaptive=False)
    return ThreadPlan(affinity, max(1, min(len(affinity), default_threads)), adaptive=True)


def host_thread_plan(cpu_threads: int | None) -> ThreadPlan:
    """This process's plan: its environment, the cores it may use, and torch's default count
    (one thread per physical core) as the adaptive ceiling."""
    affinity = frozenset(os.sched_getaffinity(0))
    import torch  # here: a config plans threads without importing torch for anything else

    return plan_threads(cpu_threads, os.environ, affinity, torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Busy and total ticks of some cores, and this process's own ticks, at one moment."""

    busy: int
    total: int
    own: int


def read_cpu_times(cores: frozenset[int], proc: Path = Path("/proc")) -> CpuTimes:
    busy = total = 0
    for line in (proc / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(value) for value in fields[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
            total += sum(ticks)
    own_fields = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
    own = int(own_fields[11]) + int(own_fields[12])  # utime, stime
    return CpuTimes(busy=busy, total=total, own=own)


def others_cores(before: CpuTimes, after: CpuTimes, num_cores: int) -> float:
    """How many of the cores other processes kept busy between two readings."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others * num_cores / elapsed)


def threads_left(plan: ThreadPlan, others: float) -> int:
    """One thread per core the others leave free (their light use costs none), at least one:
    a team wider than the free cores waits at every barrier for a descheduled member."""
    free = len(plan.cores) - max(0.0, others - OTHERS_SLACK)
    return max(1, min(plan.threads, int(free)))


class ThreadGovernor:
    """Called before each step on the thread that runs them: applies the plan there once
    (its thread count, its cores when bound), then, when adaptive, re-reads the host every
    `SAMPLE_S` and sets the count the other processes leave."""

    def __init__(
        self,
        plan: ThreadPlan,
        read: Callable[[frozenset[int]], CpuTimes] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] | None = None,  # None: torch.set_num_threads
    ) -> None:
        import torch

        self.plan = plan
        self.threads = plan.threads
        self._read, self._clock = read, clock
        self._set_threads = set_threads or torch.set_num_threads
        self._last: tuple[float, CpuTimes] | None = None

    def before_step(self) -> None:
        if self._last is None:
            if self.plan.bound:
                os.sched_setaffinity(0, self.plan.cores)
            self._set_threads(self.threads)
            self._last = (self._clock(), self._read(self.plan.cores))
            return
        now = self._clock()
        if not self.plan.adaptive or now - self._last[0] < SAMPLE_S:
            return
        times = self._read(self.plan.cores)
        threads = threads_left(self.plan, others_cores(self._last[1], times, len(self.plan.cores)))
        self._last = (now, times)
        if threads != self.threads:
            logger.info("compute threads %d -> %d (other processes' load)", self.threads, threads)
            self.threads = threads
            self._set_threads(threads)


def place_front_end(plan: ThreadPlan, affinity: frozenset[int]) -> None:
    """Keep the calling thread (the HTTP event loop) and the threads it starts off the bound
    compute cores, where others are left."""
    rest = affinity - plan.cores
    if plan.bound and rest:
        os.sched_setaffinity(0, rest)
