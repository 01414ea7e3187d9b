"""The shared KV tier's store stopped under load: a real `blockserve serve --kv-remote-url` on a
local Redis server, --clients streaming clients cycling over a shared-prefix prompt pool whose
prefixes overflow the device cache (so the store serves hits), the store stopped at --stop-at
seconds. Against a server without the tier on the same load: failed requests, answers that
differ from its (greedy, float32), and output tokens per second in 1 s windows: the tier-less
mean, and how long after the stop the tiered server's 3 s mean is back within 10% of it.

    .venv/bin/python benchmarks/bench_tier_faults.py [--seconds 40] [--stop-at 15]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

from blockserve.bench.load import one_request
from blockserve.bench.redis_server import RedisServer
from blockserve.bench.server_process import ServerProcess

SERVER_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", "96"]


def prompt_pool(groups: int, per_group: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pool = []
    for _ in range(groups):
        system = [rng.randrange(100, 40000) for _ in range(system_len)]
        pool += [system + [rng.randrange(100, 40000) for _ in range(32)] for _ in range(per_group)]
    rng.shuffle(pool)
    return pool


async def drive(url: str, pool: list[list[int]], args: argparse.Namespace, at_stop: Any) -> list:
    """(finish time, prompt index, answer or None on failure), closed loop, --seconds long."""
    order = itertools.cycle(range(len(pool)))
    finished: list[tuple[float, int, list[int] | None]] = []
    begin = time.perf_counter()

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() - begin < args.seconds:
            index = next(order)
            try:
                _, answer = await one_request(http, url, pool[index], args.output_len)
            except httpx.HTTPError:
                answer = None
            finished.append((time.perf_counter() - begin, index, answer))

    async def stopper() -> None:
        await asyncio.sleep(args.stop_at)
        at_stop()

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(stopper(), *(client(http) for _ in range(args.clients)))
    return finished


def windows(finished: list, output_len: int, seconds: int) -> list[float]:
    """Output tokens per second in each 1 s window."""
    counts = [0.0] * seconds
    for at, _, answer in finished:
        if answer is not None and int(at) < seconds:
            counts[int(at)] += output_len
    return counts


def run(args: argparse.Namespace, pool: list[list[int]], store: RedisServer | None, log: Path):
    flags = [*SERVER_ARGS, *(["--kv-remote-url", store.url] if store else [])]
    server = ServerProcess(flags, log)
    try:
        stop = store.stop if store is not None else (lambda: None)
        return asyncio.run(drive(server.url, pool, args, stop))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--stop-at", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pool = prompt_pool(groups=6, per_group=8, system_len=512)
    with tempfile.TemporaryDirectory() as root:
        plain = run(args, pool, None, Path(root) / "plain.log")
        store = RedisServer(Path(root), maxmemory="2gb")
        tiered = run(args, pool, store, Path(root) / "tiered.log")
        store.stop()
    reference = {index: answer for _, index, answer in plain if answer is not None}
    wrong = sum(
        1 for _, i, answer in tiered if answer is not None and i in reference
        and answer != reference[i]
    )  # fmt: skip
    base = windows(plain, args.output_len, args.seconds)
    mean = statistics.mean(base[5:])  # past the start-up
    ours = windows(tiered, args.output_len, args.seconds)
    stop = int(args.stop_at)
    back = next(
        (t - stop for t in range(stop, args.seconds - 2)
         if statistics.mean(ours[t : t + 3]) >= 0.9 * mean),
        None,
    )  # fmt: skip
    emit(
        {
            "benchmark": "tier_faults",
            "server_args": SERVER_ARGS,
            "clients": args.clients,
            "requests": len(tiered),
            "failed_requests": sum(1 for *_, answer in tiered if answer is None),
            "compared_answers": sum(1 for _, i, a in tiered if a is not None and i in reference),
            "wrong_answers": wrong,
            "tierless_tokens_per_s": round(mean, 1),
            "tiered_before_stop_tokens_per_s": round(statistics.mean(ours[5:stop]), 1),
            "tiered_after_stop_tokens_per_s": round(statistics.mean(ours[stop:]), 1),
            "seconds_back_within_10pct": back,
            "tierless_windows": base,
            "tiered_windows": ours,
            "stop_at_s": args.stop_at,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
