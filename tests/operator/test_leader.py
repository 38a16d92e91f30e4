"""Leader election on a Lease: the pure decision (exhaustively over small worlds) and two or
three electors racing on the real API server, with a clock the test moves."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from impvm.operator.leader import (
    LEADER_URL_ANNOTATION,
    Acquire,
    LeaderElector,
    LeaseView,
    Observation,
    Renew,
    Standby,
    Timing,
    lease_move,
    observe,
)

T = Timing(lease_duration=15, renew_deadline=10, retry_period=2)


def _lease(holder: str, renew: str = "t1", transitions: int = 0) -> LeaseView:
    return LeaseView(holder, renew, transitions, "1")


def test_timing_must_be_ordered() -> None:
    for bad in ((10, 10, 2), (15, 10, 10), (15, 20, 2), (15, 10, 0)):
        with pytest.raises(ValueError):
            Timing(*bad)


def test_decide_table() -> None:
    seen = Observation(("b", "t1"), 100.0)
    assert lease_move(None, "a", seen, 100, T) == Acquire(create=True, transitions=0)
    assert lease_move(_lease("a"), "a", seen, 100, T) == Renew()
    assert lease_move(_lease("b"), "a", seen, 114.9, T) == Standby("b")
    assert lease_move(_lease("b", transitions=3), "a", seen, 115, T) == Acquire(False, 4)
    assert lease_move(_lease(""), "a", seen, 100, T) == Acquire(False, 1)  # released


@given(
    holder=st.sampled_from(["", "a", "b"]),
    changes=st.lists(st.tuples(st.sampled_from(["b", "c"]), st.floats(0, 30)), max_size=6),
    wait=st.floats(0, 40),
)
def test_a_standby_takes_over_only_after_a_full_lease_without_change(
    holder: str, changes: list[tuple[str, float]], wait: float
) -> None:
    """Whatever the history of changes it saw, replica ``a`` takes a Lease held by another
    only when it has seen no change for ``lease_duration`` by its own clock."""
    now, seen = 0.0, None
    view = _lease(holder, "t0")
    seen = observe(view, seen, now)
    for i, (who, dt) in enumerate(changes):
        now += dt
        view = _lease(who, f"t{i + 1}")
        seen = observe(view, seen, now)
    last_change = seen.seen_at
    now += wait
    seen = observe(view, seen, now)  # the same record: no change
    assert seen.seen_at == last_change
    action = lease_move(view, "a", seen, now, T)
    if view.holder == "a":
        assert action == Renew()
    elif view.holder == "" or now - last_change >= T.lease_duration:
        assert isinstance(action, Acquire)
    else:
        assert action == Standby(view.holder)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.controlplane
async def test_one_leader_and_takeover_after_the_lease_expires(akube: AsyncClient) -> None:
    name = f"leader-{uuid.uuid4().hex[:6]}"
    clock = Clock()
    electors = [
        LeaderElector(
            akube, "default", name, f"r{i}", url=f"http://r{i}", timing=T, monotonic=clock
        )
        for i in range(3)
    ]
    try:
        for e in electors:
            await e.step()
        leaders = [e for e in electors if e.leading()]
        assert len(leaders) == 1
        first = leaders[0]
        standbys = [e for e in electors if e is not first]
        assert all(s.leader_url == first.url for s in standbys)
        lease = await akube.get(Lease, name, namespace="default")
        assert lease.spec.holderIdentity == first.identity
        assert lease.metadata.annotations[LEADER_URL_ANNOTATION] == first.url

        # the leader renews: the standbys stay standbys however long it goes on
        for _ in range(20):
            clock.t += T.retry_period
            for e in electors:
                await e.step()
            assert [e.leading() for e in electors].count(True) == 1 and first.leading()

        # the leader stops (kill -9): it stops counting as leader after the renew deadline,
        # before anyone else may take over
        clock.t += T.renew_deadline
        assert not first.leading()
        for s in standbys:
            assert isinstance(await s.step(), Standby)
        clock.t += T.lease_duration - T.renew_deadline
        for s in standbys:
            await s.step()
        new = [s for s in standbys if s.leading()]
        assert len(new) == 1  # the race for the expired Lease has one winner (resourceVersion)
        lease = await akube.get(Lease, name, namespace="default")
        assert lease.spec.holderIdentity == new[0].identity
        assert lease.spec.leaseTransitions == 1

        # the old leader comes back: it sees another holder and stays a standby
        await first.step()
        assert not first.leading() and first.leader_url == new[0].url
    finally:
        await akube.delete(Lease, name, namespace="default")


@pytest.mark.controlplane
async def test_hold_returns_when_renewals_fail_and_fences_at_once(akube: AsyncClient) -> None:
    """A leader whose renewals fail stops leading ``renew_deadline`` after its last success
    (the fencing check), and :meth:`hold` returns then."""
    name = f"leader-{uuid.uuid4().hex[:6]}"
    timing = Timing(lease_duration=1.5, renew_deadline=1.0, retry_period=0.2)
    e = LeaderElector(akube, "default", name, "solo", timing=timing)
    try:
        await e.acquire()
        assert e.leading()
        holding = asyncio.create_task(e.hold())
        await asyncio.sleep(0.5)
        assert not holding.done() and e.leading()
        e.namespace = "no-such-namespace"  # every renewal fails from now on (404 on write)
        await asyncio.wait_for(holding, 10)
        assert not e.leading()
    finally:
        await akube.delete(Lease, name, namespace="default")


@pytest.mark.controlplane
async def test_a_released_lease_is_taken_at_once(akube: AsyncClient) -> None:
    """A clean stop gives the Lease up: the standby takes it at its next look, not after the
    lease duration (the clock does not move)."""
    name = f"leader-{uuid.uuid4().hex[:6]}"
    clock = Clock()
    a = LeaderElector(akube, "default", name, "a", timing=T, monotonic=clock)
    b = LeaderElector(akube, "default", name, "b", timing=T, monotonic=clock)
    try:
        await a.step()
        assert isinstance(await b.step(), Standby)
        await a.release()
        assert not a.leading()
        assert isinstance(await b.step(), Acquire) and b.leading()
        await a.release()  # not leading: nothing happens
        assert (await akube.get(Lease, name, namespace="default")).spec.holderIdentity == "b"
    finally:
        await akube.delete(Lease, name, namespace="default")
