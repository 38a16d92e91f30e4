"""The job table: forward-only state, dedupe, routing, pending demand, sweep."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from impvm.scaling.jobs import Job, PoolScope, concerned, route, tied
from impvm.scaling.jobtable import JobTable, JobTables
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
    t.apply(only_big, POOLS)
    assert route(t.jobs[1], POOLS) == BIG.key  # SMALL would fit tighter but did not verify it
    assert t.pending(SMALL.key, POOLS) == 0 and t.pending(BIG.key, POOLS) == 1
    # verified by no pool that could run it: not even recorded
    assert t.apply(job(2, allowed=frozenset({("other", "pool")})), POOLS) is None
    assert 2 not in t.jobs
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


# --------------------------------------------------------------------------------------------
# Tenants: what a delivery may change, routing within one installation, bounds


A = PoolScope(
    PoolLabels(namespace="team-a", name="ci", labels=("imp",), created=1.0, uid="a"),
    org="o",
    prefix="ci-aaaaa-",
)
B = PoolScope(
    PoolLabels(namespace="team-b", name="ci", labels=("imp", "b"), created=2.0, uid="b"),
    org="o",
    prefix="ci-bbbbb-",
)
TENANTS = [A, B]
BY_A = frozenset({("team-a", "ci")})
BY_B = frozenset({("team-b", "ci")})
B_JOB = ("self-hosted", "imp", "b")  # only B's pool can run it


def test_a_delivery_changes_nothing_its_verifiers_could_not_own() -> None:
    t = JobTable()
    t.apply(job(1, labels=B_JOB))  # a poll: GitHub says B's job is queued
    for status in ("in_progress", "completed"):
        forged = job(1, status, labels=("self-hosted", "imp"), allowed=BY_A, runner_name="x")
        assert t.apply(forged, TENANTS) is None  # judged on the job recorded, not the claim
    assert t.pending(B.key, TENANTS) == 1 and t.jobs[1].labels == B_JOB


def test_a_completed_delivery_never_ends_a_job_for_good() -> None:
    t = JobTable()
    t.apply(job(1, labels=B_JOB))
    assert t.apply(job(1, "completed", labels=B_JOB, allowed=BY_B), TENANTS) is not None
    assert t.pending(B.key, TENANTS) == 0  # out of demand
    assert t.apply(job(1, "in_progress", labels=B_JOB, allowed=BY_B), TENANTS) is None
    arrived = t.last_arrival
    assert t.apply(job(1, labels=B_JOB)) is not None  # GitHub still sees it queued: back
    assert t.pending(B.key, TENANTS) == 1 and t.last_arrival == arrived  # not a new arrival
    assert t.apply(job(1, "completed", labels=B_JOB)) is not None  # GitHub's read ends it
    assert t.apply(job(1, labels=B_JOB)) is None and 1 not in t.jobs


def test_a_delivery_names_only_its_verifiers_runners() -> None:
    t = JobTable()
    t.apply(job(1))  # routed to A (tightest)
    victim = "ci-bbbbb-0a1b2c"  # one of B's runners
    t.apply(job(1, "in_progress", allowed=BY_A, runner_name=victim), TENANTS)
    assert t.running_on([victim]) == {} and t.jobs[1].runner_name is None
    own = "ci-aaaaa-0a1b2c"
    t.apply(job(1, "in_progress", allowed=BY_A, runner_name=own), TENANTS)
    assert t.running_on([own]) == {own: t.jobs[1]}


def test_deliveries_are_deduplicated_per_verifier() -> None:
    t = JobTable()
    assert not t.seen_delivery("d1", ("team-b",))
    assert not t.seen_delivery("d1", ("team-a",))  # B cannot make A's delivery a redelivery
    assert t.seen_delivery("d1", ("team-a",))


@given(st.integers(1, 60))
def test_a_flood_evicts_only_the_flooders_own_jobs(flood: int) -> None:
    """Each origin (GitHub's reads, each set of verifying namespaces) holds at most
    ``max_jobs`` open jobs: B's forged deliveries push out B's own, never A's or GitHub's."""
    t = JobTable(max_jobs=10)
    for i in range(1, 6):
        t.apply(job(i))  # polled
        t.apply(job(100 + i, allowed=BY_A), TENANTS)  # A's own deliveries
    for i in range(flood):
        t.apply(job(1000 + i, labels=B_JOB, allowed=BY_B), TENANTS)
    assert {1, 2, 3, 4, 5, 101, 102, 103, 104, 105} <= set(t.jobs)
    assert sum(1 for j in t.jobs.values() if j.allowed == BY_B) == min(flood, 10)
    assert t.evicted == max(0, flood - 10)


def test_routing_stays_within_one_installation() -> None:
    tables = JobTables()
    mine = PoolScope(A.key, org="o", installation="gh#installation/1")
    theirs = PoolScope(B.key, org="o", installation="gh#installation/2")
    unproven = PoolScope(
        PoolLabels(namespace="c", name="ci", labels=("imp",)), org="o", installation=None
    )
    pools = [mine, theirs, unproven]
    one = tables.of("gh#installation/1")
    one.apply(job(1, labels=("self-hosted", "imp", "b")))  # fits B's labels, in A's installation
    one.apply(job(2))
    assert one.pending(theirs.key, pools) == 0 and one.pending(mine.key, pools) == 1
    assert route(one.jobs[1], pools) is None and route(one.jobs[2], pools) == mine.key
    assert one.pending(unproven.key, pools) == 0
    assert tables.get(None) is None and tables.get("gh#installation/2") is None


def test_ties_go_to_the_oldest_pool_and_are_reported() -> None:
    t = JobTable()
    early = PoolScope(PoolLabels(namespace="zz", name="p", labels=("imp",), created=1), org="o")
    late = PoolScope(PoolLabels(namespace="aa", name="p", labels=("imp",), created=9), org="o")
    t.apply(job(1))
    assert route(t.jobs[1], [late, early]) == early.key
    assert tied(t.jobs[1], [late, early]) == (early.key, late.key)
    assert tied(t.jobs[1], [early]) == ()


def test_a_change_concerns_the_pool_of_the_job_and_of_its_runner() -> None:
    """Who a poll or delivery wakes: the pool a job belongs to, and the pool whose runner it
    runs on, of those its record allows; a job nobody can run wakes nobody."""
    assert concerned(job(1), TENANTS) == {A.key.key}
    assert concerned(job(1, labels=B_JOB), TENANTS) == {B.key.key}
    assert concerned(job(1, labels=("self-hosted", "gpu")), TENANTS) == frozenset()
    on_b = job(1, "in_progress", runner_name="ci-bbbbb-0a1b2c")  # A's job taken by B's runner
    assert concerned(on_b, TENANTS) == {A.key.key, B.key.key}
    ran = job(1, "completed", labels=("self-hosted", "gpu"), runner_name="ci-bbbbb-0a1b2c")
    assert concerned(ran, TENANTS) == {B.key.key}  # only its runner's pool cares
    # a delivery A's secret verified never wakes B for B's runner name
    told = job(1, "in_progress", labels=("x",), runner_name="ci-bbbbb-0a1b2c", allowed=BY_A)
    assert concerned(told, TENANTS) == frozenset()
    assert concerned(job(1, repo="elsewhere/app"), TENANTS) == frozenset()
