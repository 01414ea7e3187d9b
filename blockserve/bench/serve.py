"""HTTP serving benchmark in the spirit of `vllm bench serve`: streaming clients against a real
`blockserve serve`, latency percentiles, throughput, and the server's prefix-cache hit rate."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

from blockserve.bench.harness import table
from blockserve.bench.load import VOCAB_HIGH

# Datasets (token-id prompts, so lengths are exact; `ignore_eos` makes outputs exact too):
#   random         independent random prompts
#   shared-prefix  G groups × P prompts: a per-group system prompt + a distinct question each
#   multi-turn     C conversations × T turns: each turn resends the whole conversation so far
#
# Load: a fixed number of concurrent clients (--concurrency) or Poisson arrivals (--request-rate).
# With --compare-caching the script starts two servers itself (prefix caching on, then off) and
# plots both TTFT distributions; otherwise pass --url of a running server.
#
#     blockserve bench serve --dataset shared-prefix --compare-caching


def server_hit_rate(url: str) -> float | None:
    import httpx

    text = httpx.get(f"{url}/metrics").text
    values = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        match = re.search(rf"^blockserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    queries = values["prefix_cache_queries_total"]
    return round(values["prefix_cache_hits_total"] / queries, 4) if queries else None


def plot_ttft(runs: dict[str, dict], path: Path, title: str) -> Path | None:
    """Each run's TTFT distribution, where matplotlib is installed (the `plots` extra): the
    plot's path, or None."""
    try:
        import matplotlib
    except ImportError:
        return None

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
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        choices=["random", "shared-prefix", "multi-turn", "image-chat"],
        default="shared-prefix",
        help="shared-prefix: groups of questions behind one system prompt; random: nothing "
        "shared; multi-turn: conversations whose every turn extends the last; image-chat: "
        "chats about one 640 x 480 picture each, --num-prompts of them, --turns questions, "
        "arriving at --request-rate (default 0.1) chats/s (a vision-language model's) "
        "(default: shared-prefix)",
    )
    parser.add_argument(
        "--num-groups", type=int, default=4, help="shared-prefix: system prompts (default 4)"
    )
    parser.add_argument(
        "--prompts-per-group",
        type=int,
        default=16,
        help="shared-prefix: questions behind each system prompt (default 16)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="random: prompts; multi-turn, image-chat: conversations",
    )
    parser.add_argument(
        "--turns", type=int, default=4, help="multi-turn, image-chat: turns per conversation"
    )
    parser.add_argument(
        "--system-len", type=int, default=1024, help="tokens of each system prompt (default 1024)"
    )
    parser.add_argument(
        "--question-len", type=int, default=64, help="tokens of each question (default 64)"
    )
    parser.add_argument(
        "--output-len", type=int, default=64, help="tokens each request generates (default 64)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="clients sending at once (default 16)"
    )
    parser.add_argument(
        "--request-rate", type=float, default=0.0, help="Poisson arrivals per s (0: --concurrency)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the datasets' random seed")
    parser.add_argument(
        "--max-token-id",
        type=int,
        default=VOCAB_HIGH,
        help="prompts draw token ids from [100, this): below the model's vocabulary size",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="adapters the server serves: each shared-prefix group, conversation or random "
        "prompt names one, in turn (vLLM's picks one per request at random)",
    )
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument(
        "--compare-caching", action="store_true", help="run with caching on and off"
    )
    parser.add_argument("--server-args", default="", help="extra flags for the started server")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results/serving"),
        help="where the JSON, the TTFT plot and the server's log go "
        "(default: benchmarks/results/serving)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON, not a table")


SERVE_COLUMNS = [
    "setting",
    "requests",
    "wall s",
    "req/s",
    "output tok/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TPOT p50 ms",
    "cached tokens",
    "server hit rate",
]


def summary(runs: dict[str, dict]) -> str:
    rows = [
        [
            label,
            run["requests"],
            run["wall_s"],
            run["request_throughput_per_s"],
            run["output_tokens_per_s"],
            run["ttft"].get("p50_ms"),
            run["ttft"].get("p90_ms"),
            run["tpot"].get("p50_ms"),
            run["cached_tokens_reported"],
            run["server_prefix_cache_hit_rate"],
        ]
        for label, run in runs.items()
    ]
    return table(SERVE_COLUMNS, rows)


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """Each setting's run: against `--url`, or a server started per setting."""
    from blockserve.bench import image_chat, load
    from blockserve.bench.server_process import ServerProcess

    run_load = image_chat.run_load if args.dataset == "image-chat" else load.run_load

    runs: dict[str, dict] = {}
    settings = [("caching on", []), ("caching off", ["--no-enable-prefix-caching"])]
    if not args.compare_caching or args.url is not None:
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
            runs[label] = load.summarize(results, wall, server_hit_rate(url))
        finally:
            if server is not None:
                server.stop()
    return runs


def run_command(args: argparse.Namespace) -> int:
    """Run the load, write `serving-<dataset>[-rate<r>].json` and its TTFT plot to --out-dir
    and print the report (without the TTFT samples)."""
    from blockserve.bench.harness import host_stamp
    from blockserve.replay.report import PLOTS_NEED

    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = measure(args)
    report = {
        "benchmark": "serving",
        "dataset": args.dataset,
        "config": {k: str(v) for k, v in vars(args).items() if k not in ("out_dir", "url")},
        "runs": runs,
        **host_stamp(),
    }
    if len(runs) == 2:
        on, off = runs["caching on"]["ttft"]["p50_ms"], runs["caching off"]["ttft"]["p50_ms"]
        report["p50_ttft_ratio_on_over_off"] = round(on / off, 4)
    stem = f"serving-{args.dataset}"
    load = f"{args.concurrency} clients"
    if args.request_rate:
        stem += f"-rate{args.request_rate:g}"
        load = f"Poisson arrivals, {args.request_rate:g} req/s"
    json_path = args.out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plotted = plot_ttft(runs, args.out_dir / f"{stem}-ttft.png", f"TTFT, {args.dataset}, {load}")
    if args.json:
        printable = {
            label: {k: v for k, v in run.items() if k != "ttft_samples_s"}
            for label, run in runs.items()
        }
        print(json.dumps({**report, "runs": printable}, indent=2))
        return 0
    print(summary(runs))
    if "p50_ttft_ratio_on_over_off" in report:
        print(f"TTFT p50 with caching / without: {report['p50_ttft_ratio_on_over_off']}")
    print(f"wrote {json_path}" + (f" and {plotted}" if plotted else f" ({PLOTS_NEED})"))
    return 0
