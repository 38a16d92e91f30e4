"""The job tables: what the operator knows of workflow jobs, fed by webhooks and polling.

Pure and in-memory (no I/O, time is an argument): after a restart they are rebuilt from GitHub
(a poll) and from ``ImpVM.status.job`` (docs/architecture.md: in-memory state is a cache).

**One table per installation** (:class:`JobTables`): the jobs seen through one App installation
(or one PAT), keyed by ``Job.installation`` (:attr:`impvm.github.auth.CredentialIdentity.
installation`). A poll feeds the table of the credentials that read it; a delivery feeds only
the tables of the installations whose pools' webhook secret verified it and whose credentials
GitHub accepted for the installation the delivery names. A job is routed only to pools whose
credentials are that installation, so no pool ever gets demand, a job record or a tombstone
from an installation its credentials cannot reach.

Rules of one table:

- a job's state only moves forward: queued/waiting → in_progress → completed; an observation
  that would move it back (GitHub does not guarantee order) changes nothing;
- a job belongs to at most one pool: the pools whose scope covers its repository and whose
  labels it matches, then :func:`impvm.scaling.labels.choose_pool` (tightest fit, then the
  oldest pool: never a name a tenant chose);
- **only GitHub's own reads end a job** (a poll that sees it completed, or the stale-job sweep
  of a complete poll): their tombstone refuses every later observation. A ``completed``
  *delivery* only takes the job out of demand until GitHub's next read: a poll that still sees
  it queued or in progress brings it back (without counting it as an arrival again);
- **a delivery changes only what its verifiers could own** (``Job.allowed``: the pools whose
  webhook secret verified it): a job it did not create changes only when one of those pools
  could run it (scope, labels; judged on the recorded job, never on what the delivery claims),
  and a runner name is taken from a delivery only when it is one of those pools' runners. The
  repository, run and labels of a recorded job never change;
- pending demand of a pool = its queued jobs not yet assigned a runner;
- **bounded**: each *origin* holds at most ``max_jobs`` open jobs; a new job beyond that evicts
  the oldest job *of the same origin*. The origin of a job GitHub read is the installation
  itself; the origin of a job only deliveries told of is the set of namespaces whose pools
  verified them. So a tenant flooding deliveries signed with its own secret evicts only its own
  jobs, never another tenant's or GitHub's (``evicted`` counts evictions). The memories of
  tombstones, of jobs ended by deliveries and of arrivals are bounded too
  (``max_remembered`` each, per origin), and delivery ids are remembered per verifying set;
- every job first recorded queued is an arrival (:class:`Arrival`, numbered in the order
  recorded, across all tables), what the warm pool's arrival rate counts
  (:mod:`impvm.scaling.warmpool`); a job first seen already in progress is none.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from impvm.scaling.jobs import GITHUB, RANK, Arrival, Job, Origin, PoolScope, route
from impvm.scaling.labels import PoolLabels


class _Numbering:
    """The arrival numbers shared by every table of one operator."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self.last = 0

    def take(self) -> int:
        self.last = next(self._next)
        return self.last


def _remember(memory: OrderedDict[int, None], key: int, bound: int) -> None:
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > bound:
        memory.popitem(last=False)


@dataclass
class JobTable:
    """The jobs of one installation by id, with per-origin bounds (see the module docstring).
    ``max_jobs``: open jobs per origin; ``max_remembered``: per-origin memories (tombstones,
    jobs ended by deliveries, arrivals) and delivery ids per verifying set."""

    max_remembered: int = 10000
    max_jobs: int = 5000
    installation: str = ""
    jobs: dict[int, Job] = field(default_factory=dict)
    #: evictions made to keep an origin within ``max_jobs``
    evicted: int = 0
    _order: dict[Origin, OrderedDict[int, None]] = field(default_factory=dict)
    _completed: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _ended: dict[Origin, OrderedDict[int, None]] = field(default_factory=dict)
    _deliveries: dict[Origin, OrderedDict[str, None]] = field(default_factory=dict)
    _arrivals: dict[Origin, deque[tuple[Arrival, Job]]] = field(default_factory=dict)
    _numbering: _Numbering = field(default_factory=_Numbering)
    #: the last job recorded completed on each runner (by runner name): what it did
    _finished: OrderedDict[str, Job] = field(default_factory=OrderedDict)

    def seen_delivery(self, delivery_id: str | None, verified_by: Origin = GITHUB) -> bool:
        """Record a delivery id for the namespaces whose secret verified it (``verified_by``);
        True when they sent it before (a redelivery: ignore it). Ids are remembered per
        verifying set, so nobody else's deliveries can make one look like a redelivery."""
        if not delivery_id:
            return False
        memory = self._deliveries.setdefault(verified_by, OrderedDict())
        if delivery_id in memory:
            return True
        memory[delivery_id] = None
        while len(memory) > self.max_remembered:
            memory.popitem(last=False)
        return False

    def _ran(self, job: Job) -> None:
        """Remember that ``job`` ended on its runner (bounded like the other memories)."""
        if job.runner_name:
            self._finished[job.runner_name] = job
            self._finished.move_to_end(job.runner_name)
            while len(self._finished) > self.max_remembered:
                self._finished.popitem(last=False)

    def finished_on(self, runner_names: Iterable[str]) -> dict[str, Job]:
        """The last job recorded ended on each of the given runners, by runner name (a job
        record is evidence of what a runner did: GitHub removes an ephemeral runner after its
        job). A delivery's record counts only for a runner of the pools whose secret verified
        it (:meth:`apply`), so it tells nothing about another pool's VMs."""
        return {n: self._finished[n] for n in runner_names if n in self._finished}

    # ---------------------------------------------------------------- recording

    def apply(self, job: Job, pools: Sequence[PoolScope] = ()) -> Job | None:
        """Apply one observation of a job: GitHub's own read (``job.allowed`` None) or a
        delivery (``job.allowed``: the pools whose secret verified it; ``pools``: every pool
        as routing sees it, to judge what those could own). Returns the job as now recorded
        (for a ``completed`` one: as it ended), or None when the observation changed nothing
        (stale, duplicate, refused, or a job already ended)."""
        rank = RANK.get(job.status)
        if rank is None or job.id in self._completed:
            return None
        old = self.jobs.get(job.id)
        allowed = job.allowed
        from_github = allowed is None
        verifiers = GITHUB
        if allowed is not None:
            owners = [p for p in pools if (p.key.namespace, p.key.name) in allowed]
            judged = old if old is not None else job
            owners = [p for p in owners if p.could_own(judged)]
            if not owners:
                return None  # nothing its verifiers could own: it changes nothing
            if job.runner_name and not any(p.owns_runner(job.runner_name) for p in owners):
                job = replace(job, runner_name=None)  # not one of its verifiers' runners
            job = replace(job, allowed=frozenset((p.key.namespace, p.key.name) for p in owners))
            verifiers = job.origin
            if old is None and job.id in self._ended.get(verifiers, ()):
                return None  # these verifiers ended it: only GitHub's read brings it back
        if old is not None:
            old_rank = RANK[old.status]
            widened = old.allowed is not None and (
                job.allowed is None or not job.allowed <= old.allowed
            )
            if rank < old_rank or (
                rank == old_rank and job.runner_name in (None, old.runner_name) and not widened
            ):
                return None
            job = replace(
                job,
                run_id=job.run_id if from_github else old.run_id,
                repository=old.repository,
                seen_at=old.seen_at,
                allowed=None
                if job.allowed is None or old.allowed is None
                else old.allowed | job.allowed,
                labels=old.labels or job.labels,
                runner_name=job.runner_name or old.runner_name,
                started_at=job.started_at or old.started_at,
            )
        job = replace(job, installation=self.installation or job.installation)
        if rank == 2:
            self._drop(job.id)
            if from_github:
                _remember(self._completed, job.id, self.max_remembered)
                self._ran(job)
            else:  # out of demand until GitHub's next read; never a tombstone
                ended = self._ended.setdefault(verifiers, OrderedDict())
                _remember(ended, job.id, self.max_remembered)
                self._ran(job)  # its verifiers' own runner: evidence for their pool alone
            return job
        revived = old is None and from_github and self._forget_ended(job.id)
        if old is None and rank == 0 and not revived:
            log = self._arrivals.setdefault(job.origin, deque())
            log.append((Arrival(self._numbering.take(), job.seen_at), job))
            while len(log) > self.max_remembered:
                log.popleft()
        self._put(job, old)
        return job

    def _forget_ended(self, job_id: int) -> bool:
        found = False
        for m in self._ended.values():
            if job_id in m:
                del m[job_id]
                found = True
        return found

    def _put(self, job: Job, old: Job | None) -> None:
        """Store ``job`` and keep its origin within ``max_jobs``."""
        if old is not None and old.origin != job.origin:
            self._order.get(old.origin, OrderedDict()).pop(job.id, None)
        order = self._order.setdefault(job.origin, OrderedDict())
        self.jobs[job.id] = job
        if job.id not in order:
            order[job.id] = None
        while len(order) > self.max_jobs:
            victim, _ = order.popitem(last=False)
            self.jobs.pop(victim, None)
            self.evicted += 1

    def _drop(self, job_id: int) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            order = self._order.get(job.origin)
            if order is not None:
                order.pop(job_id, None)
                if not order:
                    del self._order[job.origin]
        return job

    # ---------------------------------------------------------------- reading

    def arrivals(self, pool: PoolLabels, pools: Sequence[PoolScope], after: int) -> list[Arrival]:
        """The arrivals numbered above ``after`` that are routed to ``pool`` (in ``seq``
        order; each origin's log keeps its last ``max_remembered``)."""
        out: list[Arrival] = []
        for log in self._arrivals.values():
            for a, job in reversed(log):  # newest first: stop at the first one read
                if a.seq <= after:
                    break
                if route(self.jobs.get(job.id, job), pools) == pool:
                    out.append(a)
        out.sort(key=lambda a: a.seq)
        return out

    @property
    def last_arrival(self) -> int:
        """``seq`` of the latest arrival of every table sharing this one's numbering (0: none
        yet)."""
        return self._numbering.last

    def pending(self, pool: PoolLabels, pools: Sequence[PoolScope]) -> int:
        """Queued jobs routed to ``pool`` and not yet assigned a runner."""
        return sum(1 for j in self.jobs.values() if j.queued and route(j, pools) == pool)

    def unmatched(self, pools: Sequence[PoolScope]) -> list[Job]:
        """Queued jobs no pool matches."""
        return [j for j in self.jobs.values() if j.queued and route(j, pools) is None]

    def running_on(self, runner_names: Iterable[str]) -> dict[str, Job]:
        """In-progress jobs by runner name, for the given runners."""
        names = set(runner_names)
        return {
            j.runner_name: j
            for j in self.jobs.values()
            if j.status == "in_progress" and j.runner_name in names
        }

    def sweep(
        self,
        repositories: Iterable[str],
        still_queued: Iterable[int],
        before: datetime,
        still_running: Iterable[int] | None = None,
    ) -> list[int]:
        """Stale-job sweep after a complete poll of ``repositories`` (GitHub's own read of
        this installation): drop queued jobs of those repositories that the poll did not see
        queued, and — when the poll also listed the running jobs (``still_running``: ids it saw
        queued or in progress) — in-progress jobs it did not see (their run finished and the
        ``completed`` delivery was lost). Only jobs recorded before the poll started
        (``before``) are dropped: a job a webhook recorded during the poll is kept. Dropped
        in-progress jobs are remembered as completed, so a late delivery cannot bring them
        back. Returns the ids dropped."""
        repos = {r.casefold() for r in repositories}
        keep = set(still_queued)
        running = None if still_running is None else set(still_running) | keep
        dropped = [
            j.id
            for j in self.jobs.values()
            if j.repository.casefold() in repos
            and j.seen_at < before
            and (
                (j.queued and j.id not in keep)
                or (not j.queued and running is not None and j.id not in running)
            )
        ]
        for i in dropped:
            gone = self._drop(i)
            if gone is not None and not gone.queued:
                _remember(self._completed, i, self.max_remembered)
                self._ran(gone)
        return dropped


@dataclass
class JobTables:
    """The job tables of one operator, one per installation (made on first use; see the
    module docstring). ``max_remembered``/``max_jobs``: each table's bounds."""

    max_remembered: int = 10000
    max_jobs: int = 5000
    tables: dict[str, JobTable] = field(default_factory=dict)
    _numbering: _Numbering = field(default_factory=_Numbering)

    def of(self, installation: str) -> JobTable:
        """The table of ``installation``."""
        table = self.tables.get(installation)
        if table is None:
            table = self.tables[installation] = JobTable(
                max_remembered=self.max_remembered,
                max_jobs=self.max_jobs,
                installation=installation,
                _numbering=self._numbering,
            )
        return table

    def get(self, installation: str | None) -> JobTable | None:
        """The table of ``installation`` if there is one (None for an unproven pool)."""
        return self.tables.get(installation) if installation is not None else None

    @property
    def last_arrival(self) -> int:
        """``seq`` of the latest arrival in any table (0: none yet)."""
        return self._numbering.last

    def forget(self, installation: str) -> None:
        """Drop the table of an installation no credentials use any more."""
        self.tables.pop(installation, None)
