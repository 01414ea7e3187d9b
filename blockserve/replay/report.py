"""Running a trace at several capacities and policies, and reporting it as table, JSON, plot."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from blockserve.replay.simulate import (
    ReplayResult,
    estimate_lru,
    next_uses,
    replay_belady,
    replay_infinite,
    replay_policy,
)
from blockserve.replay.trace import TraceRequest, block_layouts

DEFAULT_CAPACITIES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
BOUNDS = ("belady", "infinite")
ESTIMATES = ("lru-estimate",)  # the online miss-ratio curve's, from one pass


def run_lab(
    trace: Sequence[TraceRequest],
    capacities: Sequence[int],
    policies: Sequence[str],
    block_size: int,
    progress: bool = True,
) -> list[ReplayResult]:
    """Every policy and both bounds at every capacity (capacities in blocks), and the online
    miss-ratio curve's LRU estimate at all of them from one pass."""
    layouts = block_layouts(trace, block_size)
    uses = next_uses(layouts)
    results = estimate_lru(trace, layouts, capacities, block_size)
    with tqdm(
        total=len(capacities) * (len(policies) + 2), desc="Replaying", disable=not progress
    ) as bar:
        for capacity in capacities:
            for policy in policies:
                result, _ = replay_policy(trace, layouts, capacity, policy, block_size)
                results.append(result)
                bar.update(1)
            results.append(replay_belady(trace, layouts, capacity, block_size, uses))
            bar.update(1)
            results.append(replay_infinite(trace, layouts, block_size, capacity))
            bar.update(1)
    return results


def format_table(results: Sequence[ReplayResult], block_size: int) -> str:
    """Token hit rate per capacity (rows) and policy (columns), plus evictions."""
    names = list(dict.fromkeys(r.policy for r in results))
    capacities = sorted({r.capacity_blocks for r in results if r.capacity_blocks is not None})
    by_key = {(r.capacity_blocks, r.policy): r for r in results}
    header = [
        "capacity (blocks)",
        "tokens",
        *[f"{n} hit%" for n in names],
        *[f"{n} evictions" for n in names if n not in BOUNDS + ESTIMATES],
    ]
    rows = [header]
    for capacity in capacities:
        row = [str(capacity), f"{capacity * block_size:,}"]
        row += [f"{100 * by_key[(capacity, n)].token_hit_rate:.1f}" for n in names]
        row += [
            f"{by_key[(capacity, n)].evictions:,}" for n in names if n not in BOUNDS + ESTIMATES
        ]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        " | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def to_json(results: Sequence[ReplayResult], trace_path: str, block_size: int) -> dict:
    return {
        "trace": trace_path,
        "trace_block_size": block_size,
        "results": [
            {
                **asdict(r),
                "token_hit_rate": round(r.token_hit_rate, 5),
                "block_hit_rate": round(r.block_hit_rate, 5),
                "seconds": round(r.seconds, 3),
            }
            for r in results
        ],
    }


def plot(results: Sequence[ReplayResult], path: Path, title: str) -> None:
    """Token hit rate against capacity: one line per policy, bounds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r.policy for r in results):
        points = sorted(
            (r.capacity_blocks or 0, r.token_hit_rate) for r in results if r.policy == name
        )
        style = "--" if name in BOUNDS else ":" if name in ESTIMATES else "-"
        axes.plot(
            [p[0] for p in points], [100 * p[1] for p in points], style, marker="o", label=name
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("KV cache capacity (blocks)")
    axes.set_ylabel("prefix-cache token hit rate (%)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


PLOTS_NEED = "the plot needs matplotlib: .venv/bin/pip install 'blockserve[plots]'"


def write_reports(
    results: Sequence[ReplayResult], out_dir: Path, trace_path: str, block_size: int
) -> tuple[Path, Path | None]:
    """replay.json, and replay.png where matplotlib is installed (the `plots` extra; `make
    serve` installs the runtime alone): the paths written, None for a plot not drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "replay.json"
    json_path.write_text(json.dumps(to_json(results, trace_path, block_size), indent=2) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        return json_path, None
    png_path = out_dir / "replay.png"
    plot(results, png_path, f"Prefix-cache hit rate on {Path(trace_path).name}")
    return json_path, png_path
