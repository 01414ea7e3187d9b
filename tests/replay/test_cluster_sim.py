"""The cluster replay: N real pools behind a routing policy, on hand-built traces."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from blockserve.cli import main
from blockserve.cluster.policies import make_policy
from blockserve.errors import InvalidConfigError
from blockserve.replay.cluster_sim import ClusterShape, ServiceModel, replay_cluster
from blockserve.replay.trace import TraceRequest, block_layouts

B = 4


def request(ms: float, ids: list[int], unique: int, output_length: int = 0) -> TraceRequest:
    """len(ids) shared full blocks, one block of its own (`unique`), one partial token."""
    return TraceRequest(ms, (len(ids) + 1) * B + 1, output_length, (*ids, unique, unique + 1))


# Two prefix groups, A = [1, 2] and B = [3, 4], alternating, one request per second.
GROUPS = [request(1000.0 * i, [1, 2] if i % 2 == 0 else [3, 4], 100 + 10 * i) for i in range(8)]


def run(router: str, trace: list[TraceRequest], replicas: int = 2, capacity: int = 8):
    policy = make_policy(router, capacity, seed=0)
    shape = ClusterShape(replicas, capacity, B)
    return replay_cluster(trace, block_layouts(trace, B), policy, shape, ServiceModel(B, 1.0))


def test_kv_router_keeps_each_group_on_one_replica() -> None:
    """kv: A's first request goes to replica 0, B's (no overlap, 0 is busy) to replica 1;
    every later request of a group hits its 2 shared blocks on its own replica."""
    result = run("kv", GROUPS)
    assert result.requests_per_replica == (4, 4)
    assert result.hit_tokens == 6 * 2 * B
    assert result.query_tokens == 8 * (3 * B + 1)


def test_kv_router_keeps_each_adapter_on_the_replica_that_cached_it() -> None:
    """One prefix under two adapters, alternating: they are two groups to the router (their
    hashes differ), each kept on a replica of its own, each later request hitting its 2
    shared blocks, as GROUPS' two prefixes are."""
    trace = [dataclasses.replace(r, hash_ids=(1, 2, *r.hash_ids[2:]), lora_name=f"a{i % 2}")
             for i, r in enumerate(GROUPS)]  # fmt: skip
    result = run("kv", trace)
    assert result.requests_per_replica == (4, 4)
    assert result.hit_tokens == 6 * 2 * B


def test_round_robin_splits_the_groups_when_they_alternate_out_of_phase() -> None:
    """Round robin sends A to 0 and B to 1 here too (they alternate): the same hits; shifted
    by one request (A B B A A B B) it mixes them: 3 hits where kv gets all 5 repeats."""
    assert run("round-robin", GROUPS).hit_tokens == 6 * 2 * B
    order = [0, 1, 3, 2, 4, 5, 7]  # A B B A A B B
    shifted = [dataclasses.replace(GROUPS[j], timestamp=1000.0 * i) for i, j in enumerate(order)]
    # Round robin: replica 0 gets A B A B, replica 1 gets B A B: 3 repeats hit, 2 blocks each.
    assert run("round-robin", shifted).hit_tokens == 3 * 2 * B
    assert run("kv", shifted).hit_tokens == 5 * 2 * B


def test_service_model_gives_queueing_delay_and_load() -> None:
    """One replica, prefill 4 tokens/s: a 13-token miss takes 3.25 s, so the request arriving
    1 s later waits 2.25 s and then computes its 5 uncached tokens (1.25 s): TTFT 3.5 s."""
    trace = [request(0.0, [1, 2], 100), request(1000.0, [1, 2], 110)]
    result = run("kv", trace, replicas=1)
    assert result.computed_tokens_per_replica == (13 + 5,)
    assert (result.ttft_p50_s, result.ttft_p90_s) == (3.5, 3.5)
    assert result.load_imbalance == 1.0


def test_requests_larger_than_a_replica_are_skipped() -> None:
    """A request of more blocks than one replica holds is counted as skipped, not run."""
    result = run("kv", [request(0.0, list(range(1, 12)), 100)], capacity=8)
    assert (result.num_skipped, result.query_tokens) == (1, 0)


def test_shape_is_checked() -> None:
    """Zero replicas or blocks is a config error."""
    with pytest.raises(InvalidConfigError):
        ClusterShape(0, 8, B)


def write_trace(tmp_path: Path) -> Path:
    trace_path = tmp_path / "trace.jsonl"
    trace_path.write_text(
        "\n".join(
            json.dumps(
                {
                    "timestamp": r.timestamp,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            for r in GROUPS
        )
    )
    return trace_path


def test_cli_cluster_replay_writes_a_row_per_router(tmp_path: Path, capsys) -> None:
    """`replay --replicas 1,2 --router kv,pow2`: one row for 1 replica, one per router at 2."""
    argv = [
        "replay",
        str(write_trace(tmp_path)),
        "--replicas",
        "1,2",
        "--router",
        "kv,pow2",
        "--capacities",
        "8",
        "--trace-block-size",
        str(B),
        "--out-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "replay_cluster.json").read_text())
    rows = [(r["num_replicas"], r["router"]) for r in report["results"]]
    assert rows == [(1, "kv"), (2, "kv"), (2, "pow2")]
    assert report["results"][1]["hit_tokens"] == 6 * 2 * B
    assert "hit rate" in capsys.readouterr().out


def test_cli_cluster_replay_takes_the_kv_routers_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--router-prefix-weight` reaches the kv policy, as `serve`'s flag does; below 0 it is
    refused before anything runs."""
    made: list[tuple[str, float]] = []

    def recording(name: str, capacity: int, prefix_weight: float, seed: int | None = None):
        made.append((name, prefix_weight))
        return make_policy(name, capacity, prefix_weight, seed)

    monkeypatch.setattr("blockserve.replay.cluster_report.make_policy", recording)
    argv = ["replay", str(write_trace(tmp_path)), "--replicas", "2", "--router", "kv"]
    argv += ["--capacities", "8", "--trace-block-size", str(B), "--out-dir", str(tmp_path)]
    assert main([*argv, "--router-prefix-weight", "0.5"]) == 0
    assert made == [("kv", 0.5)]
    assert main([*argv, "--router-prefix-weight", "-1"]) == 2
    assert made == [("kv", 0.5)]
