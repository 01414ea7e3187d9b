"""Mooncake traces: reading JSONL records, and laying requests out in hashed blocks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from blockserve.core.hashing import block_hash_to_uint64
from blockserve.errors import InvalidRequestError
from blockserve.replay.trace import TraceRequest, block_layouts, load_trace

SAMPLE_TRACE = Path(__file__).parents[2] / "benchmarks" / "data" / "mooncake_synthetic_trace.jsonl"


def test_load_trace_rejects_malformed_lines(tmp_path: Path) -> None:
    """A line that is not a trace record names its file and line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 0}\n'
    )
    with pytest.raises(InvalidRequestError, match=r"bad\.jsonl:2"):
        load_trace(path)


def test_an_unreadable_trace_is_one_clear_error(tmp_path: Path) -> None:
    """A missing file or a directory is an InvalidRequestError naming it, not an OSError."""
    with pytest.raises(InvalidRequestError, match=r"cannot read the trace .*nope\.jsonl: No such"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(InvalidRequestError, match="Is a directory"):
        load_trace(tmp_path)


def test_the_shipped_sample_trace_loads() -> None:
    """The trace in benchmarks/data has its documented 3,993 requests, times in order."""
    trace = load_trace(SAMPLE_TRACE)
    assert len(trace) == 3993
    assert trace[0].timestamp == 0.0
    assert all(a.timestamp <= b.timestamp for a, b in itertools.pairwise(trace))


def test_layout_counts_prompt_hittable_and_held_blocks() -> None:
    """input 9, output 4, blocks of 4: 2 prompt blocks (both hittable: (9-1)//4), 3 full
    blocks in all (one of output), 4 held (13 tokens); equal ids give equal prompt hashes."""
    first, second = block_layouts(
        [TraceRequest(0.0, 9, 4, (7, 8, 9)), TraceRequest(1.0, 9, 4, (7, 8, 5))], 4
    )
    assert (first.num_prompt_blocks, first.num_hittable_blocks, first.num_blocks) == (2, 2, 4)
    assert len(first.block_hashes) == 3
    assert first.block_hashes[:2] == second.block_hashes[:2]
    assert first.block_hashes[2] != second.block_hashes[2]  # output blocks are per request


def test_an_adapters_blocks_are_its_own(tmp_path: Path) -> None:
    """`lora_name` (ours, optional) keys every prompt block, as the engine's extra key: equal
    ids under two adapters, or an adapter and the base model, share no hash."""
    path = tmp_path / "lora.jsonl"
    rows = [(None, "null"), ("a", '"a"'), ("b", '"b"'), ("a", '"a"')]
    path.write_text("".join(
        f'{{"timestamp": {i}, "input_length": 9, "output_length": 0, "hash_ids": [7, 8, 9], '
        f'"lora_name": {name}}}\n' for i, (_, name) in enumerate(rows)
    ))  # fmt: skip
    trace = load_trace(path)
    assert [r.lora_name for r in trace] == [name for name, _ in rows]
    base, a, b, a_again = (layout.block_hashes[:2] for layout in block_layouts(trace, 4))
    assert a == a_again
    assert len({base, a, b}) == 3 and not set(base) & set(a) and not set(a) & set(b)
    # The event form (the last 8 bytes, as routers read it) differs too.
    assert len({block_hash_to_uint64(h[0]) for h in (base, a, b)}) == 3


def test_too_few_hash_ids_for_the_block_size_is_refused() -> None:
    """A trace read with the wrong block size is caught, with a hint."""
    with pytest.raises(InvalidRequestError, match="is --trace-block-size right"):
        block_layouts([TraceRequest(0.0, 64, 0, (1,))], 16)
