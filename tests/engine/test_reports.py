"""The engine core's KV cache reports (engine/reports.py), on a real manager."""

from __future__ import annotations

from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.engine.reports import kv_cache_report, miss_ratio_report
from tests.core.helpers import admit, make_manager, make_request


def test_the_kv_report_counts_what_a_request_holds() -> None:
    """One 9-token request holds 3 of 10 usable blocks (2 full ones cached) in a sound pool."""
    manager = make_manager(num_blocks=11)
    assert admit(manager, make_request("a", range(9))) == 0
    report = kv_cache_report(manager)
    assert (report.num_blocks, report.num_free_blocks, report.num_cached_hashes) == (11, 7, 2)
    assert (report.num_requests_holding_blocks, report.integrity_errors) == (1, ())


def test_the_miss_ratio_report_reads_17_sizes_around_this_cache() -> None:
    """16 usable blocks: 1/16x to 16x in steps of sqrt(2), rounded: 16 sizes (1 and sqrt(2)
    both round to 1); no points without a curve."""
    manager = make_manager(num_blocks=17)
    assert miss_ratio_report(manager, None).points == ()
    report = miss_ratio_report(manager, MissRatioCurve(manager.block_size))
    capacities = [point.capacity_blocks for point in report.points]
    assert capacities == [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128, 181, 256]
    assert report.num_blocks == 16
