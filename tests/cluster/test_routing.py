"""`InFlight`: each replica's requests in flight, from Ray Serve's reports in either order."""

from __future__ import annotations

from blockserve.cluster.routing import InFlight


def test_a_request_is_counted_from_its_routing_to_its_end() -> None:
    """Routed, then ended: counted on its replica in between, once however often reported."""
    in_flight = InFlight()
    assert (in_flight.routed("a", "r1"), in_flight.routed("a", "r2")) == (True, True)
    assert in_flight.routed("a", "r1") is True  # reported twice: still one request
    assert (in_flight.count("a"), in_flight.count("b")) == (2, 0)
    assert in_flight.ended("a", "r1") is True
    assert (in_flight.count("a"), in_flight.ended("a", "r1")) == (1, False)


def test_a_request_that_ends_before_its_routing_is_never_counted() -> None:
    """Serve reports the end first: the routing that follows counts nothing, and only once."""
    in_flight = InFlight()
    assert in_flight.ended("a", "r1") is False
    assert in_flight.routed("a", "r1") is False
    assert in_flight.count("a") == 0
    assert in_flight.routed("a", "r1") is True  # a later routing of that id counts again
    assert in_flight.count("a") == 1


def test_an_end_reported_by_another_replica_leaves_the_request_counted() -> None:
    """A refused attempt's end on "a" after the request was routed to "b" ends nothing on "b"."""
    in_flight = InFlight()
    assert in_flight.routed("b", "r1") is True
    assert in_flight.ended("a", "r1") is False
    assert (in_flight.count("a"), in_flight.count("b")) == (0, 1)


def test_unmatched_ends_are_bounded_and_a_forgotten_replica_loses_them() -> None:
    """Ends with nothing counted are kept, oldest dropped past the bound; forget drops a
    replica's requests and its unmatched ends."""
    in_flight = InFlight(max_unmatched=2)
    for request_id in ("r1", "r2", "r3"):
        assert in_flight.ended("a", request_id) is False
    assert in_flight.routed("a", "r1") is True  # dropped: this routing counts
    assert (in_flight.routed("a", "r2"), in_flight.routed("a", "r3")) == (False, False)
    in_flight.ended("b", "r4")
    assert in_flight.routed("b", "r5") is True
    in_flight.forget("b")
    assert (in_flight.count("b"), in_flight.routed("b", "r4")) == (0, True)
    assert in_flight.count("a") == 1
