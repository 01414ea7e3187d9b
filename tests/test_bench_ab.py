"""benchmarks/bench_ab.py's arithmetic and turn order (its workers need our bf16 kernels and a
build of the revision's; the script itself is run by hand, its results under
benchmarks/results/ab/)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_ab import summarize, take_turns


def test_turns_alternate_which_side_goes_first() -> None:
    order: list[str] = []

    def side(name: str, seconds: float):
        def measure() -> float:
            order.append(name)
            return seconds

        return measure

    here, there = take_turns(side("here", 1.0), side("there", 2.0), rounds=3)
    assert order == ["here", "there", "there", "here", "here", "there"]
    assert (here, there) == ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])


def test_summary_is_the_median_of_per_round_ratios() -> None:
    # The third round ran on a slower host for both sides: each round's ratio (0.5, 0.857,
    # 0.5) compares like with like; the ratio of the medians would read 0.6.
    here = [0.010, 0.012, 0.030]
    there = [0.020, 0.014, 0.060]
    assert summarize(here, there) == {
        "rounds": 3,
        "here_ms": 12.0,
        "revision_ms": 20.0,
        "ratio": 0.5,
        "here_faster_rounds": 3,
    }
