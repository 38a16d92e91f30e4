from __future__ import annotations

import datetime as dt

from impvm.scaling.nodes import NodeLease, lost_nodes, node_lost

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def ago(s: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=s)


def test_lost_only_past_duration_plus_grace() -> None:
    leases = [
        NodeLease("fresh", ago(5), 40),
        NodeLease("edge", ago(100), 40),  # exactly duration + grace: not yet
        NodeLease("gone", ago(101), 40),
        NodeLease("never", None, 40),
    ]
    assert lost_nodes(leases, NOW, grace_seconds=60) == {"gone", "never"}


def test_node_without_lease_is_lost_unbound_is_not() -> None:
    known, lost = {"a", "b"}, {"b"}
    assert not node_lost("a", known, lost)
    assert node_lost("b", known, lost)
    assert node_lost("c", known, lost)
    assert not node_lost(None, known, lost)
    assert not node_lost("", known, lost)
