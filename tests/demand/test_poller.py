"""The installation's job poller against the GitHub stand-in over real HTTP: one poll for all
its pools, coalesced requests, conditional reads all the way down, failures reaching every pool
that asked, stale-job sweeps limited to what was read, and the budget with 500 repositories."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import SecretStr

from impvm.api.times import as_clock
from impvm.devstack.seed import make_private_key
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.records import Failure
from impvm.github import AppCredentials, GitHubClient, RetryPolicy, Scope
from impvm.github.errors import TransientError
from impvm.operator.poller import InstallationPoller
from impvm.scaling.jobs import Job
from impvm.scaling.jobtable import JobTable
from impvm.scaling.pollbudget import PollBudget, sweep_polls
from tests.support import standin_fixture

APP_ID, INSTALLATION_ID, ORG = 4343, 78, "poll-org"
REPO = f"{ORG}/app"
PERMISSIONS = {"actions": "read", "metadata": "read"}
RUNS = "/repos/{owner}/{repo}/actions/runs"
JOBS = "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs"
REPOS = "/installation/repositories"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def private_key() -> str:
    return make_private_key(pkcs8=True)


standin = standin_fixture(APP_ID, INSTALLATION_ID, ORG, PERMISSIONS, [REPO])


@pytest.fixture
async def client(standin: StandIn, private_key: str) -> AsyncIterator[GitHubClient]:
    c = GitHubClient(
        AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(private_key)),
        api_url=standin.url,
        retry=RetryPolicy(max_transient_retries=0),
    )
    yield c
    await c.close()


def poller_for(
    client: GitHubClient, clock: Clock, budget: PollBudget | None = None
) -> InstallationPoller:
    return InstallationPoller(client, JobTable(), as_clock(clock), budget or PollBudget())


def calls(standin: StandIn, path: str | None = None) -> list[dict[str, Any]]:
    return [r for r in standin.state.requests if path is None or r["path"] == path]


async def test_one_poll_serves_every_scope_and_pool_that_asks_together(
    standin: StandIn, client: GitHubClient
) -> None:
    other = f"{ORG}/lib"
    standin.state.add_repo(other)
    a = standin.state.queue_job(REPO, ["self-hosted", "a"])
    b = standin.state.queue_job(other, ["self-hosted", "b"])
    clock = Clock()
    poller = poller_for(client, clock)
    org, repo = Scope(org=ORG), Scope(repo=other)
    since = clock()
    reports = await asyncio.gather(
        poller.poll(org, since), poller.poll(org, since), poller.poll(repo, since)
    )
    # the first poll started with the scopes asked before it began; the repository scope's
    # request came while it ran with another scope set, or joined it: at most two polls
    assert {r.number for r in reports} <= {1, 2}
    assert set(poller.jobs.jobs) == {a.id, b.id}
    assert poller.queued(org) == 2 and poller.queued(repo) == 1
    listed = [r["url"] for r in calls(standin, RUNS)]
    assert listed.count(f"/repos/{REPO}/actions/runs") <= 2 * len({r.number for r in reports})
    # a pool asking later for a poll no fresher than the last gets it without a request
    before = len(calls(standin))
    again = await poller.poll(org, since)
    assert again is poller.last and len(calls(standin)) == before


async def test_a_request_is_answered_only_by_a_poll_that_started_after_it(
    standin: StandIn, client: GitHubClient
) -> None:
    clock = Clock()
    poller = poller_for(client, clock)
    scope = Scope(org=ORG)
    first = await poller.poll(scope, None)
    assert (await poller.poll(scope, first.started)).number == first.number
    clock.t += 30
    second = await poller.poll(scope, first.started + 30)
    assert second.number == first.number + 1 and second.started == first.started + 30


async def test_unchanged_runs_cost_two_304s_and_no_jobs_read(
    standin: StandIn, client: GitHubClient
) -> None:
    job = standin.state.queue_job(REPO, ["self-hosted", "x"])
    clock = Clock()
    poller = poller_for(client, clock)
    scope = Scope(org=ORG)
    first = await poller.poll(scope, None)
    assert first.failure is None and first.repositories == (REPO,)
    jobs_reads = len(calls(standin, JOBS))
    assert jobs_reads == 1
    standin.state.requests.clear()
    clock.t += 30
    second = await poller.poll(scope, clock())
    runs = calls(standin, RUNS)
    assert [(r["status"], r["conditional"]) for r in runs] == [(304, True), (304, True)]
    assert calls(standin, JOBS) == []  # the kept answer, not even a 304
    assert second.api_calls == second.not_modified == len(calls(standin))
    assert poller.jobs.jobs[job.id].status == "queued"
    # the job starts: the run changes, its jobs are read again
    standin.state.jobs[job.id].status = "in_progress"
    standin.state.jobs[job.id].runner_name = "r-1"
    standin.state.sync_run(job.run_id)
    standin.state.requests.clear()
    clock.t += 30
    await poller.poll(scope, clock())
    assert [r["status"] for r in calls(standin, JOBS)] == [200]
    assert poller.jobs.jobs[job.id].status == "in_progress"


async def test_a_failed_poll_reaches_every_pool_that_asked(
    standin: StandIn, client: GitHubClient
) -> None:
    clock = Clock()
    poller = poller_for(client, clock)
    standin.state.failures.append(Failure(kind="status", status=502, path=RUNS, count=1))
    org, repo = Scope(org=ORG), Scope(repo=REPO)
    await poller.poll(repo, None)  # registers the second scope; fails
    first = poller.last
    assert first is not None and isinstance(first.failure, TransientError)
    served = await asyncio.gather(poller.poll(org, first.started), poller.poll(repo, None))
    assert served[1].failure is first.failure  # the same poll answered it
    assert served[0].failure is None or served[0].number == first.number


async def test_stale_jobs_are_swept_only_in_repositories_the_poll_read(
    standin: StandIn, client: GitHubClient
) -> None:
    for i in range(9):
        standin.state.add_repo(f"{ORG}/r{i}")
    clock = Clock()
    # 1 listing + 2 repositories (2 run listings each) a poll
    poller = poller_for(client, clock, PollBudget(calls_per_hour=5 * 3600 / 60, burst_seconds=60))
    old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    stale = {
        r: Job(id=i, run_id=i, repository=r, labels=("self-hosted",), status="queued", seen_at=old)
        for i, r in enumerate(sorted(standin.state.repos), start=1)
    }
    for j in stale.values():
        poller.jobs.apply(j)
    report = await poller.poll(Scope(org=ORG), None)
    assert report.failure is None and 0 < len(report.repositories) < len(stale)
    kept = {j.repository for j in poller.jobs.jobs.values()}
    assert kept == set(stale) - set(report.repositories)


async def test_jobs_of_a_repository_that_left_the_installation_are_dropped(
    standin: StandIn, client: GitHubClient
) -> None:
    """No poll reads a repository the installation no longer has, so the next listing of the
    installation is what drops its jobs (else the org's pools count them as demand for ever)."""
    gone = f"{ORG}/leaving"
    standin.state.add_repo(gone)
    job = standin.state.queue_job(gone, ["self-hosted", "x"])
    clock = Clock()
    poller = poller_for(client, clock)
    scope = Scope(org=ORG)
    first = await poller.poll(scope, None)
    assert first.failure is None and job.id in poller.jobs.jobs and poller.queued(scope) == 1
    del standin.state.repos[gone]
    for _ in range(3):  # the next listing comes once the sweep of the last one is done
        clock.t += 60
        assert (await poller.poll(scope, clock())).failure is None
    assert job.id not in poller.jobs.jobs and poller.queued(scope) == 0


async def test_500_repositories_within_the_budget(standin: StandIn, client: GitHubClient) -> None:
    """With 500 repositories and a budget of 150 requests a poll: the polls stay within it, the
    repository with a queued job is read in every poll, and
    every repository is read within the sweep bound."""
    names = [f"{ORG}/repo-{i:03d}" for i in range(499)]
    for r in names:
        standin.state.add_repo(r)
    job = standin.state.queue_job(names[250], ["self-hosted", "x"])
    clock = Clock()
    budget = PollBudget(calls_per_hour=18000, rate_limit_share=0.5, burst_seconds=30)
    poller = poller_for(client, clock, budget)
    scope = Scope(org=ORG)
    read: dict[str, int] = {}
    total = 0
    bound = sweep_polls(499, 3, budget.per_poll(30), listing_pages=5)
    assert bound == 8
    for n in range(1, 2 * bound + 1):
        standin.state.requests.clear()
        report = await poller.poll(scope, clock())
        assert report.failure is None
        made = [r for r in calls(standin) if not r["path"].endswith("/access_tokens")]
        assert report.api_calls == len(made) and report.budget <= 150
        total += len(made)
        # a poll overruns only by the jobs of runs it found in a repository thought idle (here
        # one), and the debt is paid by the next: the bucket's refill bounds the sum
        assert total <= 150 * n + 1
        for r in report.repositories:
            read.setdefault(r, n)
        assert report.swept == (len(read) == 500)  # webhook-mode pools poll on until then
        if job.id in poller.jobs.jobs:  # once found, its repository is hot: read every poll
            assert names[250] in report.repositories
        clock.t += 30
    assert len(read) == 500 and max(read.values()) <= bound
    assert job.id in poller.jobs.jobs


async def test_polls_keep_within_their_share_of_the_rate_limit_window(
    standin: StandIn, client: GitHubClient
) -> None:
    """A share of 1 % of the installation's 5,000 an hour: 50 requests that cost rate limit in
    GitHub's window, whatever the all-calls budget allows; 304s do not count."""
    for i in range(199):
        standin.state.add_repo(f"{ORG}/many-{i:03d}")
    clock = Clock()
    budget = PollBudget(calls_per_hour=360_000, rate_limit_share=0.01, burst_seconds=60)
    poller = poller_for(client, clock, budget)
    costly = 0
    for _ in range(6):
        report = await poller.poll(Scope(org=ORG), clock())
        assert report.failure is None
        costly += report.api_calls - report.not_modified
        clock.t += 30
    assert 0 < costly <= 50
