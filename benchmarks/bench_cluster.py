"""The routers raced on a real Ray Serve cluster: `blockserve serve --replicas N --router R`.

Workload: G groups, each a long system prompt shared by conversations of T turns (G x C of them,
the groups Zipf-popular: a few system prompts are hot, as in production); every turn
re-sends the whole conversation so far (system prompt, earlier turns and answers) plus a new
user message. Conversations start at Poisson arrivals; each sends its next turn when the
previous answer is complete. Token-id prompts and `ignore_eos`, so lengths are exact.

For each router: aggregate cached-token fraction (the servers' `cached_tokens` over prompt
tokens), TTFT p50/p90, throughput, and per-replica load (/cluster/replicas). The reference is
one replica holding the whole cluster's KV memory on the same load. `--kv-remote`: the
replicas (not the reference) share a KV tier on a local Redis server.

    .venv/bin/python benchmarks/bench_cluster.py --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_serving import RequestResult, one_request, percentiles
from benchmarks.report import emit
from blockserve.bench.server_process import ServerProcess
from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT

VOCAB_LOW, VOCAB_HIGH = 100, 40000


def make_conversations(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    """One list of token ids per conversation: its group's system prompt (shared). Group g
    is chosen with weight 1 / (g + 1) ** skew (0: all groups equally popular)."""
    systems = [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_len)]
        for _ in range(args.groups)
    ]
    weights = [1 / (g + 1) ** args.skew for g in range(args.groups)]
    count = args.groups * args.per_group
    return [list(system) for system in rng.choices(systems, weights, k=count)]


async def run_load(args: argparse.Namespace, url: str) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    conversations = make_conversations(args, rng)
    starts = []
    clock = 0.0
    for _ in conversations:
        starts.append(clock)
        clock += rng.expovariate(args.rate)
    user_turns = [
        [
            [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.user_len)]
            for _ in range(args.turns)
        ]
        for _ in conversations
    ]
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        begin = time.perf_counter()

        async def converse(index: int) -> None:
            await asyncio.sleep(starts[index])
            history = conversations[index]
            # Tenants: the same prompts under different cache salts share no blocks.
            extra = {"cache_salt": f"tenant-{index % args.tenants}"} if args.tenants else None
            for turn in user_turns[index]:
                history = history + turn
                result, answer = await one_request(client, url, history, args.output_len, extra)
                results.append(result)
                history = history + answer

        await asyncio.gather(*(converse(i) for i in range(len(conversations))))
        return results, time.perf_counter() - begin


def start_cluster(args: argparse.Namespace, replicas: int, router: str, blocks: int, log: Path):
    # --kv-remote: the replicas of a cluster (not the one-replica reference) share a store.
    shared = ["--kv-remote-url", args.kv_remote_url] if args.kv_remote_url and replicas > 1 else []
    flags = [
        *shared,
        "--replicas",
        str(replicas),
        "--router",
        router,
        "--dtype",
        args.dtype,
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--router-prefix-weight",
        str(args.prefix_weight),
    ]
    server = ServerProcess(flags, log)
    if not server.wait_for_cluster(replicas, timeout=300, ours=router != "pow2"):
        server.stop()
        raise TimeoutError(f"{replicas} replicas not routable in 300 s: {server.log()}")
    return server


def measure(args: argparse.Namespace, replicas: int, router: str, blocks: int) -> dict:
    log = args.out_dir / f"cluster-{replicas}x-{router}.log"
    if args.kv_remote_url:
        args.store.client().flushall()  # every cluster starts from an empty store
    server = start_cluster(args, replicas, router, blocks, log)
    try:
        asyncio.run(run_warmup(server.url))
        results, wall = asyncio.run(run_load(args, server.url))
        per_replica = httpx.get(f"{server.url}/cluster/replicas").json()["replicas"]
    finally:
        server.stop(timeout=120)
    prompt = sum(r.prompt_tokens for r in results)
    computed = [r["prompt_tokens"] - r["cached_tokens"] for r in per_replica.values()]
    return {
        "replicas": replicas,
        "router": router,
        "blocks_per_replica": blocks,
        "requests": len(results),
        "cached_fraction": round(sum(r.cached_tokens for r in results) / prompt, 4),
        "ttft": percentiles([r.ttft for r in results]),
        "wall_s": round(wall, 2),
        "request_throughput_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in results) / wall, 1),
        # per replica: the warm-up request included (8 prompt tokens on one replica)
        "per_replica": per_replica,
        "computed_imbalance": (
            round(max(computed) * len(computed) / sum(computed), 3) if sum(computed) else None
        ),
    }


async def run_warmup(url: str) -> None:
    """One short request: the first request's one-off costs stay out of the figures."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, list(range(VOCAB_LOW, VOCAB_LOW + 8)), 2)


def summarize(runs: list[dict], replicas: int) -> dict:
    """Medians over the repeats per (replicas, router), and the ratios the targets name."""
    medians: dict[str, dict] = {}
    for key in dict.fromkeys(f"{r['replicas']}x {r['router']}" for r in runs):
        group = [r for r in runs if f"{r['replicas']}x {r['router']}" == key]
        medians[key] = {
            "cached_fraction": statistics.median(r["cached_fraction"] for r in group),
            "ttft_p50_ms": statistics.median(r["ttft"]["p50_ms"] for r in group),
            "ttft_p90_ms": statistics.median(r["ttft"]["p90_ms"] for r in group),
            "request_throughput_per_s": statistics.median(
                r["request_throughput_per_s"] for r in group
            ),
            "runs": len(group),
        }
    summary: dict = {"medians": medians}
    single = medians["1x kv"]
    summary["cached_over_single"] = {
        key: round(m["cached_fraction"] / single["cached_fraction"], 4)
        for key, m in medians.items()
        if not key.startswith("1x")
    }
    kv = medians.get(f"{replicas}x kv")
    if kv is not None:
        summary["kv_cached_over_single"] = round(
            kv["cached_fraction"] / single["cached_fraction"], 4
        )
        for other in ("pow2", "text-prefix", "round-robin"):
            if f"{replicas}x {other}" in medians:
                ratio = medians[f"{replicas}x {other}"]["ttft_p90_ms"] / kv["ttft_p90_ms"]
                summary[f"ttft_p90_{other}_over_kv"] = round(ratio, 3)
    return summary


def plot(medians: dict[str, dict], path: Path, title: str) -> None:
    """Cached fraction and TTFT p50/p90 per router (medians over the repeats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [key.replace(" ", "\n") for key in medians]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [m["cached_fraction"] for m in medians.values()], color="tab:blue")
    left.set_ylabel("cached fraction of prompt tokens")
    left.set_ylim(0, 1)
    x = range(len(medians))
    right.bar([i - 0.2 for i in x], [m["ttft_p50_ms"] / 1e3 for m in medians.values()], 0.4)
    right.bar([i + 0.2 for i in x], [m["ttft_p90_ms"] / 1e3 for m in medians.values()], 0.4)
    right.set_xticks(list(x), labels)
    right.set_ylabel("TTFT (s): p50, p90")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routers", default="kv,pow2,text-prefix,round-robin")
    parser.add_argument("--groups", type=int, default=4, help="system prompts")
    parser.add_argument(
        "--per-group", type=int, default=6, help="conversations per group, on average"
    )
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of groups")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--tenants", type=int, default=0, help="conversations take turns among N cache salts"
    )
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.5, help="conversation starts per s")
    parser.add_argument("--blocks-per-replica", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT, help="kv router's weight"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per router (a fresh cluster each)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="added to the output files' names")
    parser.add_argument(
        "--kv-remote", action="store_true",
        help="the replicas share a KV tier on a local Redis server (--kv-remote-url)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/cluster"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.kv_remote_url = None
    if args.kv_remote:
        from blockserve.bench.redis_server import RedisServer

        args.store = RedisServer(Path(tempfile.mkdtemp()), maxmemory="4gb")
        args.kv_remote_url = args.store.url
    total = args.replicas * args.blocks_per_replica
    runs = []
    for repeat in range(args.repeats):  # interleaved, so a slow spell hits every router
        # The reference: one replica holding the whole cluster's memory.
        runs.append({**measure(args, 1, "kv", total), "repeat": repeat})
        for router in args.routers.split(","):
            run = measure(args, args.replicas, router, args.blocks_per_replica)
            runs.append({**run, "repeat": repeat})
    summary = summarize(runs, args.replicas)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    stem = f"cluster-{args.replicas}x" + (f"-{args.tenants}tenants" if args.tenants else "")
    stem += "-shared-tier" if args.kv_remote else ""
    stem += f"-{args.tag}" if args.tag else ""
    plot(
        summary["medians"],
        args.out_dir / f"{stem}.png",
        f"{args.replicas} replicas, {args.groups} groups x "
        f"{args.per_group} conversations x {args.turns} turns, {args.rate:g} conv/s"
        + (f", {args.tenants} tenants" if args.tenants else ""),
    )
    config.pop("store", None)
    emit(
        {"benchmark": "cluster", "config": config, "runs": runs, "summary": summary},
        args.out_dir / f"{stem}.json",
    )
    if args.kv_remote:
        args.store.stop()


if __name__ == "__main__":
    main()
