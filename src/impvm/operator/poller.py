"""One demand poller per GitHub installation, shared by every pool of that installation.

Pools in polling or hybrid mode (and webhook-mode pools for their start-up and safety polls)
do not poll GitHub themselves: they ask the installation's :class:`InstallationPoller` with the
time from which a poll is fresh enough for them (``since``, monotonic seconds; None: any poll
since the operator started). Requests coalesce: a poll that started at or after ``since`` and
covered the pool's scope answers it, so pools whose polls fall due together share one, and a
pool that asks while a poll runs waits for it (or for the next one, when the running one started
too early or without its scope). A poll reads every registered scope at once (the union of
their repositories; each repository once), puts the jobs into the one job table (which routes
them to pools by labels and scope) and sweeps stale jobs of the repositories it read completely,
and only those. A failure ends the poll and reaches every pool the poll answers, as its
``PollOutcome`` failure (condition within the pass; backoff is decided in the pure pass).

Which repositories a poll reads, and how many requests it may make, is decided by
:func:`impvm.scaling.pollbudget.choose_repos` within the installation's budget
(:class:`impvm.scaling.pollbudget.PollBudget`: all requests an hour, and a share of the primary
rate limit for the ones that count against it; the math is in that module). Every read is
conditional (:mod:`impvm.operator.demand`).

A scope no pool asked for during ``forget_seconds`` is dropped (its pools are gone or no longer
poll).

A poll that records a change of a job (a new queued job, one taken by a runner, one completed)
wakes the pools it concerns (:func:`impvm.scaling.jobs.concerned`), except the pools
waiting for that poll (they read the job table when it answers them): a job one pool's poll
finds for another pool of the installation is acted on at once, not at that pool's next tick.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from impvm.api.models import PoolKey
from impvm.api.times import Clock
from impvm.github import GitHubClient, Scope
from impvm.github.auth import CredentialIdentity
from impvm.github.errors import GitHubError
from impvm.operator.demand import RepoMemory, RepoRead, read_repo, scope_repositories
from impvm.operator.metrics import POLL_CALLS, note_routing
from impvm.scaling.jobs import Job, PoolScope, concerned
from impvm.scaling.jobtable import JobTable, JobTables
from impvm.scaling.pollbudget import Bucket, PollBudget, RateWindow, choose_repos

__all__ = ["DEFAULT_INSTALLATION_LIMIT", "InstallationPoller", "PollReport", "Pollers"]

log = logging.getLogger("impvm.operator.poller")

#: requests an hour of a GitHub App installation before the ``x-ratelimit-limit`` of an answer
#: says otherwise (REST "Rate limits for GitHub Apps")
DEFAULT_INSTALLATION_LIMIT = 5000


def covers(scope: Scope, repository: str) -> bool:
    """Whether a pool of ``scope`` may run jobs of ``repository`` (``owner/name``)."""
    if scope.repo is not None:
        return scope.repo.casefold() == repository.casefold()
    return (scope.org or "").casefold() == repository.split("/", 1)[0].casefold()


@dataclass(frozen=True, slots=True, kw_only=True)
class PollReport:
    """One poll of an installation: its number, when it started (``started``: monotonic s;
    ``started_at``: wall time) and finished, the scopes it served, the repositories it read
    completely (of ``known`` the scopes have), the requests made and the 304s among them, and
    the failure that ended it (then it answers its pools with that failure)."""

    number: int
    started: float
    started_at: dt.datetime
    finished_at: dt.datetime
    scopes: frozenset[Scope]
    repositories: tuple[str, ...]
    known: int
    api_calls: int
    not_modified: int
    budget: int
    #: every repository of the scopes had been read once (since the poller started)
    swept: bool = True
    #: the error that ended the poll (redacted by the client)
    failure: GitHubError | None = None


class InstallationPoller:
    """Polls GitHub for the jobs of every scope its pools ask for, through ``client`` (one
    installation's), into ``jobs``. ``clock`` gives wall and monotonic time; ``budget`` bounds
    the requests (:class:`PollBudget`); ``scopes``: every pool as routing sees it; ``wake``:
    makes a pool's loop run now (the pools a poll's job changes concern)."""

    def __init__(
        self,
        client: GitHubClient,
        jobs: JobTable,
        clock: Clock,
        budget: PollBudget,
        forget_seconds: float = 900.0,
        scopes: Callable[[], Sequence[PoolScope]] | None = None,
        wake: Callable[[PoolKey], None] | None = None,
    ) -> None:
        self.client = client
        self.jobs = jobs
        self.scopes = scopes
        self.wake = wake
        #: the pools inside :meth:`poll` (they read the job table when it returns)
        self._waiting: Counter[PoolKey] = Counter()
        self.clock = clock
        self.budget = budget
        self.forget_seconds = forget_seconds
        self._asked: dict[Scope, float] = {}
        self._running: asyncio.Task[PollReport] | None = None
        self.last: PollReport | None = None
        self._number = 0
        #: the installation's repositories (sorted), and the poll that listed them
        self._installation: list[str] | None = None
        self._listed_at = 0
        self._memory: dict[str, RepoMemory] = {}
        self._cost: dict[str, int] = {}
        self._last_read: dict[str, int] = {}
        self._universe: list[str] = []
        now = clock.monotonic()
        self._all = Bucket.full(budget.calls_per_hour, budget.burst_seconds, now)
        self._window = RateWindow()

    def _rate_left(self) -> int:
        """Rate-limited requests left to polling in GitHub's current window."""
        b = self.client.rate_budget()
        limit = b.limit if b is not None and b.limit > 0 else DEFAULT_INSTALLATION_LIMIT
        self._window = self._window.at(b.reset if b is not None else 0)
        return self._window.left(self.budget.rate_limit_share, limit)

    async def poll(
        self, scope: Scope, since: float | None, pool: PoolKey | None = None
    ) -> PollReport:
        """A poll that covered ``scope`` and started at or after ``since`` (monotonic s; None:
        any), running one when there is none; ``pool``: the pool asking (it is not woken by
        the polls it waits for). Never raises a GitHub error: the report carries it. A
        cancelled caller does not cancel the shared poll."""
        self._asked[scope] = self.clock.monotonic()
        if pool is not None:
            self._waiting[pool] += 1
        try:
            while True:
                last = self.last
                if (
                    last is not None
                    and scope in last.scopes
                    and (since is None or last.started >= since)
                ):
                    return last
                if self._running is None:
                    self._running = asyncio.create_task(self._run())
                await asyncio.shield(self._running)
        finally:
            if pool is not None:
                self._waiting[pool] -= 1
                if self._waiting[pool] <= 0:
                    del self._waiting[pool]

    def queued(self, scope: Scope) -> int:
        """Queued jobs the job table holds for ``scope``'s repositories."""
        return sum(1 for j in self.jobs.jobs.values() if j.queued and covers(scope, j.repository))

    async def _run(self) -> PollReport:
        try:
            report = await self._poll_once()
        finally:
            self._running = None
        self.last = report
        return report

    def _sweep_done(self) -> bool:
        """Every repository of the last universe was read since the installation was listed."""
        return all(self._last_read.get(r, -1) >= self._listed_at for r in self._universe)

    async def _poll_once(self) -> PollReport:
        self._number += 1
        n, clock = self._number, self.clock
        mono, started_at = clock.monotonic(), clock.now()
        for scope, at in list(self._asked.items()):
            if mono - at > self.forget_seconds:
                del self._asked[scope]
        scopes = frozenset(self._asked)
        b = self.budget
        self._all = self._all.refilled(b.calls_per_hour, b.burst_seconds, mono)
        budget = max(0, min(math.floor(self._all.tokens), self._rate_left()))
        calls = not_modified = 0
        reads: list[RepoRead] = []
        failure: GitHubError | None = None
        try:
            needs_listing = any(s.org is not None for s in scopes)
            if needs_listing and (self._installation is None or self._sweep_done()):
                listed = await self.client.read_installation_repos()
                calls += listed.calls
                not_modified += listed.not_modified
                self._installation = sorted(r.full_name for r in listed.items)
                self._listed_at = n
                self._drop_removed(scopes, started_at)
            universe = sorted(
                {r for s in scopes for r in scope_repositories(s, self._installation or [])}
            )
            self._forget_except(universe)
            self._universe = universe
            choice = choose_repos(
                universe, self._hot(universe), self._cost, self._last_read, budget - calls
            )
            for repo in choice.read:
                try:
                    r = await read_repo(self.client, repo, self._memory.get(repo), started_at)
                except GitHubError:
                    calls += 1  # at least the request that failed
                    raise
                calls += r.calls
                not_modified += r.not_modified
                reads.append(r)
                self._last_read[repo] = n
                # the next read's likely cost: its listings (a changed run adds a jobs read,
                # charged when made)
                self._cost[repo] = r.listing_calls
                if r.gone:
                    self._memory.pop(repo, None)
                else:
                    self._memory[repo] = r.memory
        except GitHubError as e:
            failure = e
        self._all = self._all.spent(calls)
        self._window = self._window.charged(calls - not_modified)
        POLL_CALLS.inc(calls)
        self._apply(reads, started_at)
        report = PollReport(
            number=n,
            started=mono,
            started_at=started_at,
            finished_at=clock.now(),
            scopes=scopes,
            repositories=tuple(r.repository for r in reads),
            known=len(self._universe),
            api_calls=calls,
            not_modified=not_modified,
            budget=budget,
            swept=all(r in self._last_read for r in self._universe),
            failure=failure,
        )
        log.debug(
            "poll %d: %d of %d repositories, %d requests (%d 304s), budget %d%s",
            n,
            len(reads),
            report.known,
            calls,
            not_modified,
            budget,
            f"; failed: {failure}" if failure else "",
        )
        return report

    def _hot(self, universe: list[str]) -> set[str]:
        """Repositories with open runs at their last read or open jobs in the job table
        (webhook deliveries)."""
        by_fold = {r.casefold(): r for r in universe}
        hot = {r for r in universe if (m := self._memory.get(r)) is not None and m.open_runs}
        for job in self.jobs.jobs.values():
            name = by_fold.get(job.repository.casefold())
            if name is not None:
                hot.add(name)
        return hot

    def _drop_removed(self, scopes: frozenset[Scope], before: dt.datetime) -> None:
        """Jobs of the organisations polled whose repository has left the installation (the
        App's repository selection changed, or the repository was deleted or moved): no poll
        reads that repository again, so nothing else would ever sweep them. Repositories a
        pool names itself are left to that pool's reads."""
        orgs = {s.org.casefold() for s in scopes if s.org is not None}
        named = {s.repo.casefold() for s in scopes if s.repo is not None}
        present = {r.casefold() for r in self._installation or []}
        gone = {
            j.repository
            for j in self.jobs.jobs.values()
            if j.repository.partition("/")[0].casefold() in orgs
            and j.repository.casefold() not in present
            and j.repository.casefold() not in named
        }
        if gone:
            dropped = self.jobs.sweep(gone, (), before, ())
            log.info(
                "poll: dropped %d job(s) of %d repositories no longer in the installation",
                len(dropped),
                len(gone),
            )

    def _forget_except(self, universe: list[str]) -> None:
        keep = set(universe)
        for memory in (self._memory, self._cost, self._last_read):
            for repo in [r for r in memory if r not in keep]:
                del memory[repo]

    def _apply(self, reads: list[RepoRead], started_at: dt.datetime) -> None:
        """Jobs into the table; stale jobs of the repositories read completely swept."""
        if not reads:
            return
        queued: set[int] = set()
        open_ids: set[int] = set()
        changed: list[Job] = []
        for r in reads:
            for job in r.jobs:
                new = job.id not in self.jobs.jobs
                recorded = self.jobs.apply(job)
                if recorded is not None:
                    changed.append(recorded)
                if new and recorded is not None and recorded.queued and self.scopes is not None:
                    note_routing(recorded, self.scopes())
                if job.queued:
                    queued.add(job.id)
                if job.status != "completed":
                    open_ids.add(job.id)
        dropped = self.jobs.sweep([r.repository for r in reads], queued, started_at, open_ids)
        if dropped:
            log.info("poll: dropped %d stale job(s)", len(dropped))
        self._wake_concerned(changed)

    def _wake_concerned(self, changed: list[Job]) -> None:
        """Wake the pools the changed jobs concern, but those waiting for this poll."""
        if self.wake is None or self.scopes is None or not changed:
            return
        scopes = self.scopes()
        woken = {key for job in changed for key in concerned(job, scopes)}
        for key in sorted(woken - set(self._waiting)):
            self.wake(key)


class Pollers:
    """The pollers of one operator process: one per GitHub client (the provider hands out one
    client per credential identity, so a poller's token is always its own credentials'), each
    feeding the job table of its client's installation. ``scopes``: every pool as routing sees
    it (to count jobs that several pools fit equally well, and to find the pools a job's change
    concerns); ``wake``: makes a pool's loop run now."""

    def __init__(
        self,
        jobs: JobTables,
        clock: Clock,
        budget: PollBudget,
        scopes: Callable[[], Sequence[PoolScope]] | None = None,
        wake: Callable[[PoolKey], None] | None = None,
    ) -> None:
        self.jobs = jobs
        self.clock = clock
        self.budget = budget
        self.scopes = scopes
        self.wake = wake
        self._pollers: dict[CredentialIdentity, InstallationPoller] = {}

    def of(self, client: GitHubClient) -> InstallationPoller:
        """The poller of ``client`` (made on first use)."""
        poller = self._pollers.get(client.identity)
        if poller is None or poller.client is not client:
            table = self.jobs.of(client.identity.installation)
            poller = self._pollers[client.identity] = InstallationPoller(
                client, table, self.clock, self.budget, scopes=self.scopes, wake=self.wake
            )
        return poller

    def forget(self, client: GitHubClient) -> None:
        """``client`` is retired (its key was rotated away): its poller goes with it."""
        poller = self._pollers.get(client.identity)
        if poller is not None and poller.client is client:
            del self._pollers[client.identity]
