"""The job table: forward-only state, dedupe, routing, pending demand, sweep."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from impvm.scaling.jobtable import Job, JobTable, PoolScope, route
from impvm.scaling.labels import PoolLabels

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)

SMALL = PoolScope(PoolLabels(namespace="ns", name="small", labels=("imp",)), org="o")
BIG = PoolScope(PoolLabels(namespace="ns", name="big", labels=("imp", "big")), org="o")
REPO_ONLY = PoolScope(PoolLabels(namespace="ns", name="repo", labels=("imp",)), repo="o/app")
POOLS = [SMALL, BIG]


def job(
    i: int, status: str = "queued", labels: tuple[str, ...] = ("self-hosted", "imp"), **kw: object
) -> Job:
    return Job(
        id=i,
        run_id=100 + i,
        repository=kw.pop("repo", "o/app"),
        labels=labels,
        status=status,
        seen_at=kw.pop("at", T0),
        **kw,
    )  # type: ignore[arg-type]


def test_forward_only() -> None:
    t = JobTable()
    assert t.apply(job(1)) is not None
    assert t.apply(job(1, "in_progress", runner_name="r1")) is not None
    assert t.apply(job(1, "queued")) is None  # late queued delivery
    assert t.jobs[1].status == "in_progress" and t.jobs[1].runner_name == "r1"
    assert t.apply(job(1, "completed")) is not None
    assert 1 not in t.jobs
    assert t.apply(job(1, "in_progress", runner_name="r1")) is None  # no resurrection
    assert t.apply(job(1, "queued")) is None


def test_duplicate_observation_is_no_change() -> None:
    t = JobTable()
    t.apply(job(1))
    assert t.apply(job(1)) is None
    t.apply(job(1, "in_progress", runner_name="r"))
    assert t.apply(job(1, "in_progress", runner_name="r")) is None
    assert t.apply(job(1, "in_progress")) is None


def test_waiting_counts_as_queued_and_unknown_status_ignored() -> None:
    t = JobTable()
    assert t.apply(job(1, "waiting")) is not None
    assert t.pending(SMALL.key, POOLS) == 1
    assert t.apply(job(2, "requested")) is None


def test_delivery_dedupe_is_bounded() -> None:
    t = JobTable(max_remembered=3)
    assert not t.seen_delivery("a")
    assert t.seen_delivery("a")
    for d in "bcd":
        t.seen_delivery(d)
    assert not t.seen_delivery("a")  # forgotten after 3 newer ones
    assert not t.seen_delivery(None) and not t.seen_delivery(None)


def test_routing_tightest_pool_and_scope() -> None:
    assert route(job(1), POOLS) == SMALL.key
    assert route(job(1, labels=("self-hosted", "imp", "big")), POOLS) == BIG.key
    assert route(job(1, labels=("self-hosted", "IMP", "Big")), POOLS) == BIG.key
    assert route(job(1, labels=("self-hosted", "gpu")), POOLS) is None
    assert route(job(1, repo="other/app"), POOLS) is None  # outside every scope
    assert route(job(1, repo="o/lib"), [REPO_ONLY]) is None
    assert route(job(1, repo="O/App"), [REPO_ONLY]) == REPO_ONLY.key


def test_pending_excludes_assigned_and_other_pools() -> None:
    t = JobTable()
    t.apply(job(1))
    t.apply(job(2))
    t.apply(job(3, labels=("imp", "big")))
    t.apply(job(2, "in_progress", runner_name="small-1"))
    assert t.pending(SMALL.key, POOLS) == 1
    assert t.pending(BIG.key, POOLS) == 1
    assert t.running_on(["small-1", "x"]) == {"small-1": t.jobs[2]}
    assert [j.id for j in t.unmatched(POOLS)] == []
    t.apply(job(4, labels=("gpu",)))
    assert [j.id for j in t.unmatched(POOLS)] == [4]


def test_sweep_drops_only_old_queued_jobs_of_polled_repos() -> None:
    t = JobTable()
    t.apply(job(1, at=T0))
    t.apply(job(2, at=T0))
    t.apply(job(3, at=T0 + dt.timedelta(seconds=10)))  # arrived during the poll
    t.apply(job(4, repo="o/other", at=T0))  # repository not polled
    t.apply(job(5, at=T0))
    t.apply(job(5, "in_progress", runner_name="r"))
    dropped = t.sweep(["o/app"], still_queued=[2], before=T0 + dt.timedelta(seconds=5))
    assert dropped == [1]
    assert set(t.jobs) == {2, 3, 4, 5}


@given(st.lists(st.sampled_from(["queued", "waiting", "in_progress", "completed"]), max_size=12))
def test_state_never_moves_back(statuses: list[str]) -> None:
    rank = {"queued": 0, "waiting": 0, "in_progress": 1, "completed": 2}
    t = JobTable()
    best = -1
    for i, s in enumerate(statuses):
        t.apply(job(7, s, runner_name=f"r{i}" if s == "in_progress" else None))
        best = max(best, rank[s])
        got = t.jobs.get(7)
        if best == 2:
            assert got is None
        else:
            assert got is not None and rank[got.status] == best


def test_webhook_job_only_feeds_the_pools_that_verified_it() -> None:
    t = JobTable()
    only_big = job(1, allowed=frozenset({("ns", "big")}))
    t.apply(only_big)
    assert route(t.jobs[1], POOLS) == BIG.key  # SMALL would fit tighter but did not verify it
    assert t.pending(SMALL.key, POOLS) == 0 and t.pending(BIG.key, POOLS) == 1
    t.apply(job(2, allowed=frozenset({("other", "pool")})))
    assert route(t.jobs[2], POOLS) is None
    # the same job seen by a poll (GitHub's own answer) may go anywhere
    t.apply(job(2))
    assert route(t.jobs[2], POOLS) == SMALL.key


def test_sweep_drops_running_jobs_a_complete_poll_no_longer_sees() -> None:
    """A job whose ``completed`` delivery was lost stays in progress only until a poll that
    listed the running jobs no longer sees it; a late delivery cannot bring it back."""
    t = JobTable()
    t.apply(job(1, at=T0))
    t.apply(job(1, "in_progress", runner_name="r"))
    t.apply(job(2, at=T0))
    t.apply(job(2, "in_progress", runner_name="s"))
    t.apply(job(3, "in_progress", runner_name="u", at=T0 + dt.timedelta(seconds=10)))
    before = T0 + dt.timedelta(seconds=5)
    assert t.sweep(["o/app"], still_queued=[], before=before, still_running=[2]) == [1]
    assert set(t.jobs) == {2, 3}  # 2 still runs; 3 was recorded during the poll
    assert t.apply(job(1, "in_progress", runner_name="r")) is None
