"""Tiered replay: the device tier's hits, then the host's and the disk's, counted exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blockserve.errors import InvalidConfigError
from blockserve.replay.tier_sim import parse_tiers, replay_tiers, run_tiers
from blockserve.replay.trace import TraceRequest, block_layouts

B = 4  # tokens per trace block


def request(ids: list[int]) -> TraceRequest:
    """Two full prompt blocks and one token more: 3 blocks held, 2 that may hit."""
    return TraceRequest(0.0, len(ids) * B + 1, 0, tuple(ids))


# The device holds one request (3 blocks): [3, 4] evicts [1, 2], which come back from below.
TRACE = [request([1, 2]), request([3, 4]), request([1, 2]), request([1, 2])]
QUERY_TOKENS = 4 * 9


def run(**capacities: int) -> dict[str, int]:
    sizes = {"device": 3, "host": 0, "disk": 0, **capacities}
    result = replay_tiers(TRACE, block_layouts(TRACE, B), sizes, "lru", B)
    assert result.query_tokens == QUERY_TOKENS and result.num_skipped == 0
    return result.hit_tokens


def test_without_lower_tiers_only_the_device_hits() -> None:
    """[1, 2] is evicted by [3, 4]: the third request misses, the fourth hits its reload."""
    assert run() == {"device": 8, "host": 0, "disk": 0}


def test_the_disk_tier_serves_what_the_device_evicted() -> None:
    assert run(disk=10) == {"device": 8, "host": 0, "disk": 8}


def test_the_host_tier_is_asked_before_the_disk() -> None:
    assert run(host=10, disk=10) == {"device": 8, "host": 8, "disk": 0}


def test_a_lower_tier_too_small_keeps_only_its_most_recent_blocks() -> None:
    """A host tier of 2 blocks holds [3, 4] when [1, 2] is asked for; the disk has both."""
    assert run(host=2, disk=10) == {"device": 8, "host": 0, "disk": 8}


def test_tiers_reach_the_infinite_bound_here() -> None:
    results, infinite = run_tiers(TRACE, {"device": 3, "host": 0, "disk": 10}, ["lru"], B)
    assert results[0].total_hit_rate == infinite.token_hit_rate == 16 / QUERY_TOKENS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("host=4", "needs device=N"),
        ("device=0,disk=4", "needs device=N"),
        ("device=4,ssd=2", "got 'ssd=2'"),
        ("device=4,disk=-1", "got 'disk=-1'"),
    ],
)
def test_bad_tier_specs_are_refused(text: str, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        parse_tiers(text)
    assert parse_tiers("device=4, disk=16") == {"device": 4, "host": 0, "disk": 16}


def test_replay_command_reports_each_tier(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {
            "timestamp": 0,
            "input_length": r.input_length,
            "output_length": 0,
            "hash_ids": list(r.hash_ids),
        }
        for r in TRACE
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [
        *(sys.executable, "-m", "blockserve.cli", "replay", str(path)),
        *("--trace-block-size", str(B), "--tiers", "device=3,disk=10"),
        *("--eviction-policy", "lru,lfu", "--out-dir", str(tmp_path / "out")),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "tiers (blocks): device 3, host 0, disk 10"
    report = json.loads((tmp_path / "out" / "tiers.json").read_text())
    assert [r["policy"] for r in report["results"]] == ["lru", "lfu"]
    assert report["results"][0]["hit_tokens"] == {"device": 8, "host": 0, "disk": 8}
    assert report["infinite_token_hit_rate"] == round(16 / QUERY_TOKENS, 5)
