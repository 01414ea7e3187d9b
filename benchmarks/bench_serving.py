"""HTTP serving benchmark in the spirit of `vllm bench serve`: streaming clients against a real
`blockserve serve`, latency percentiles, throughput, and the server's prefix-cache hit rate.

Datasets (token-id prompts, so lengths are exact; `ignore_eos` makes outputs exact too):
  random         independent random prompts
  shared-prefix  G groups × P prompts: a per-group system prompt + a distinct question each
  multi-turn     C conversations × T turns: each turn resends the whole conversation so far

Load: a fixed number of concurrent clients (--concurrency) or Poisson arrivals (--request-rate).
With --compare-caching the script starts two servers itself (prefix caching on, then off) and
plots both TTFT distributions; otherwise pass --url of a running server.

    .venv/bin/python benchmarks/bench_serving.py --dataset shared-prefix --compare-caching
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.server.server_process import ServerProcess  # the test harness starts servers

VOCAB_LOW, VOCAB_HIGH = 100, 40000


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    e2e: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


@dataclass
class Conversation:
    turns: list[list[int]]  # the new tokens of each user turn
    history: list[int] = field(default_factory=list)


def shared_prefix_prompts(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    prompts = []
    for _ in range(args.num_groups):
        system = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_len)]
        for _ in range(args.prompts_per_group):
            prompts.append(
                system + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.question_len)]
            )
    rng.shuffle(prompts)
    return prompts


def random_prompts(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    length = args.system_len + args.question_len
    return [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]
        for _ in range(args.num_prompts)
    ]


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    output_len: int,
    extra: dict | None = None,
) -> tuple[RequestResult, list[int]]:
    """Stream one completion (`extra`: more body fields); returns its timings and the
    answer's token ids (multi-turn)."""
    body = {
        **(extra or {}),
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict = {}
    answer: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                # A token arrived (its text may still be incomplete): TTFT and ITL count tokens.
                answer += chunk["choices"][0]["token_ids"]
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    ttft = (arrivals[0] if arrivals else end) - start
    itls = [b - a for a, b in itertools.pairwise(arrivals)]
    result = RequestResult(
        ttft,
        itls,
        end - start,
        usage.get("prompt_tokens", len(prompt)),
        usage.get("completion_tokens", 0),
        usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    )
    return result, answer


async def run_load(args: argparse.Namespace, url: str) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=max(args.concurrency, 64))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        if args.dataset == "multi-turn":
            conversations = [
                Conversation(
                    [
                        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.question_len)]
                        for _ in range(args.turns)
                    ]
                )
                for _ in range(args.num_prompts)
            ]
            semaphore = asyncio.Semaphore(args.concurrency)

            async def converse(conv: Conversation) -> None:
                for turn in conv.turns:
                    conv.history += turn
                    async with semaphore:
                        result, answer = await one_request(
                            client, url, conv.history, args.output_len
                        )
                    results.append(result)
                    conv.history += answer

            await asyncio.gather(*(converse(c) for c in conversations))
        else:
            prompts = (
                shared_prefix_prompts(args, rng)
                if args.dataset == "shared-prefix"
                else random_prompts(args, rng)
            )
            queue: asyncio.Queue[list[int]] = asyncio.Queue()
            for prompt in prompts:
                queue.put_nowait(prompt)

            async def worker() -> None:
                while not queue.empty():
                    result, _ = await one_request(client, url, queue.get_nowait(), args.output_len)
                    results.append(result)

            async def poisson() -> None:
                tasks = []
                for prompt in prompts:
                    tasks.append(
                        asyncio.create_task(one_request(client, url, prompt, args.output_len))
                    )
                    await asyncio.sleep(rng.expovariate(args.request_rate))
                results.extend(r for r, _ in await asyncio.gather(*tasks))

            if args.request_rate:
                await poisson()
            else:
                await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3, 1)

    return {
        "mean_ms": round(statistics.mean(values) * 1e3, 1),
        "p50_ms": pick(0.5),
        "p90_ms": pick(0.9),
        "p99_ms": pick(0.99),
    }


def server_hit_rate(url: str) -> float | None:
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        match = re.search(rf"^blockserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    queries = values["prefix_cache_queries_total"]
    return round(values["prefix_cache_hits_total"] / queries, 4) if queries else None


def summarize(results: list[RequestResult], wall: float, hit_rate: float | None) -> dict:
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall, 2),
        "request_throughput_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "total_tokens_per_s": round(
            (output_tokens + sum(r.prompt_tokens for r in results)) / wall, 1
        ),
        "ttft": percentiles([r.ttft for r in results]),
        "tpot": percentiles(tpots),
        "itl": percentiles([x for r in results for x in r.itls]),
        "e2e": percentiles([r.e2e for r in results]),
        "cached_tokens_reported": sum(r.cached_tokens for r in results),
        "server_prefix_cache_hit_rate": hit_rate,
        "ttft_samples_s": [round(r.ttft, 4) for r in results],
    }


def plot_ttft(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for label, run in runs.items():
        samples = sorted(run["ttft_samples_s"])
        axes.plot(samples, [(i + 1) / len(samples) for i in range(len(samples))], label=label)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dataset", choices=["random", "shared-prefix", "multi-turn"], default="shared-prefix"
    )
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="random: prompts; multi-turn: conversations"
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per s (0: use --concurrency)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument(
        "--compare-caching", action="store_true", help="run with caching on and off"
    )
    parser.add_argument("--server-args", default="", help="extra flags for the started server")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/serving"))
    args = parser.parse_args()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    settings = [("caching on", []), ("caching off", ["--no-enable-prefix-caching"])]
    if not args.compare_caching:
        settings = settings[:1]
    for label, flags in settings:
        server = None
        url = args.url
        if url is None:
            server = ServerProcess(
                [*args.server_args.split(), *flags], args.out_dir / f"server-{len(runs)}.log"
            )
            url = server.url
        try:
            results, wall = asyncio.run(run_load(args, url))
            runs[label] = summarize(results, wall, server_hit_rate(url))
        finally:
            if server is not None:
                server.stop()
        if args.url is not None:
            break
    report = {
        "benchmark": "serving",
        "dataset": args.dataset,
        "config": {k: v for k, v in vars(args).items() if k not in ("out_dir", "url")},
        "runs": runs,
    }
    if len(runs) == 2:
        on, off = runs["caching on"]["ttft"]["p50_ms"], runs["caching off"]["ttft"]["p50_ms"]
        report["p50_ttft_ratio_on_over_off"] = round(on / off, 4)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"serving-{args.dataset}"
    load = f"{args.concurrency} clients"
    if args.request_rate:
        stem += f"-rate{args.request_rate:g}"
        load = f"Poisson arrivals, {args.request_rate:g} req/s"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_ttft(runs, args.out_dir / f"{stem}-ttft.png", f"TTFT, {args.dataset}, {load}")
    printable = {
        label: {k: v for k, v in run.items() if k != "ttft_samples_s"}
        for label, run in runs.items()
    }
    print(json.dumps({**report, "runs": printable}, indent=2))


if __name__ == "__main__":
    main()
