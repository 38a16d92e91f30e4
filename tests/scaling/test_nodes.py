from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from impvm.scaling.nodes import (
    MAX_CLOCK_SKEW_SECONDS,
    MAX_LEASE_SECONDS,
    NodeLease,
    lost_nodes,
    node_lost,
    unschedulable,
)

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


# ------------------------------------------------------------------ placement (Unschedulable)


def full(node: str, vcpu: int, mem: int, used_vcpu: int, used_mem: int, renewed: float = 5) -> Any:
    return NodeLease.parse(
        node,
        ago(renewed),
        40,
        {
            "imp.dev/vcpu": str(vcpu),
            "imp.dev/memory-mib": str(mem),
            "imp.dev/vcpu-used": str(used_vcpu),
            "imp.dev/memory-mib-used": str(used_mem),
        },
    )


def test_unschedulable_names_needed_and_free_resources() -> None:
    leases = [full("node-b", 4, 8192, 4, 4096), full("node-a", 8, 4096, 2, 3072)]
    u = unschedulable(leases, NOW, 2, 2, 2048)
    assert u is not None and u.reason == "InsufficientCapacity" and u.waiting == 2
    assert u.message == (
        "2 VM(s) wait for a node: each needs 2 vCPU, 2048 MiB; "
        "node-a 6/8 vCPU, 1024/4096 MiB free; node-b 0/4 vCPU, 4096/8192 MiB free"
    )


def test_schedulable_when_one_node_has_room_or_nothing_waits() -> None:
    leases = [full("node-a", 4, 8192, 4, 0), full("node-b", 4, 8192, 2, 6144)]
    assert unschedulable(leases, NOW, 1, 2, 2048) is None
    assert unschedulable([full("node-a", 1, 1, 1, 1)], NOW, 0, 2, 2048) is None
    # a Lease that advertises no capacity, or whose host checks failed, offers nothing: the
    # placement binds nothing there, and the condition says so
    for offers_nothing in (
        NodeLease("old", ago(1), 40),
        NodeLease("sick", ago(1), 40, 8, 8192, 0, 0, preflight_ok=False),
    ):
        verdict = unschedulable([offers_nothing], NOW, 1, 1, 1)
        assert verdict is not None and verdict.reason == "NoAgents", offers_nothing
        assert "host checks failed or no capacity" in verdict.message


def test_no_live_agent() -> None:
    expired = full("node-a", 64, 65536, 0, 0, renewed=41)
    u = unschedulable([expired], NOW, 1, 2, 2048)
    assert u is not None and u.reason == "NoAgents"
    assert u.message.endswith("no agent is running")
    assert unschedulable([], NOW, 3, 1, 256) is not None


def test_malformed_annotations_are_unknown() -> None:
    le = NodeLease.parse("n", ago(1), 40, {"imp.dev/vcpu": "many", "imp.dev/memory-mib": "1"})
    assert le.vcpu is None and le.free() is None


@given(
    nodes=st.lists(
        st.tuples(
            st.integers(0, 16), st.integers(0, 16), st.integers(0, 9000), st.integers(0, 9000)
        ),
        max_size=5,
    ),
    vcpu=st.integers(1, 8),
    mem=st.integers(256, 8192),
)
def test_unschedulable_exactly_when_no_live_node_fits(
    nodes: list[tuple[int, int, int, int]], vcpu: int, mem: int
) -> None:
    leases = [full(f"n{i}", c, m, uc, um) for i, (c, uc, m, um) in enumerate(nodes)]
    fits = any(c - uc >= vcpu and m - um >= mem for c, uc, m, um in nodes)
    assert (unschedulable(leases, NOW, 1, vcpu, mem) is None) == fits


def test_a_lease_dated_ahead_or_lasting_years_is_not_believed() -> None:
    """A node cannot stay alive on one write: a renewal beyond the clock skew is no renewal,
    and a duration over the most believed counts as that most."""
    ahead = NodeLease("ahead", NOW + dt.timedelta(days=365 * 5), 40, 8, 8192)
    eternal = NodeLease("eternal", ago(MAX_LEASE_SECONDS + 60), 10**9, 8, 8192)
    skew = dt.timedelta(seconds=MAX_CLOCK_SKEW_SECONDS - 1)
    skewed = NodeLease("skewed", NOW + skew, 40, 8, 8192)
    assert not ahead.live(NOW) and not eternal.live(NOW) and skewed.live(NOW)
    assert lost_nodes([ahead, eternal, skewed], NOW, 0) == {"ahead", "eternal"}
