"""A workflow job as the operator knows it (:class:`Job`), the pools that may run it
(:class:`PoolScope`) and which one it goes to (:func:`route`: the pools whose scope covers its
repository, whose installation it came through and whose labels it matches, then
:func:`impvm.scaling.labels.choose_pool`); an :class:`Arrival` is a job first recorded queued.
Pure. The job tables that hold them are :mod:`impvm.scaling.jobtable`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from impvm.api.models import PoolKey
from impvm.scaling.labels import PoolLabels, choose_pool, fitting_pools, job_matches
from impvm.scaling.names import owns_runner_name

#: Rank of each GitHub job status; ``waiting`` (environment protection) is still queued for us.
RANK = {"queued": 0, "waiting": 0, "in_progress": 1, "completed": 2}

#: Where a job entry came from (what the bound is counted by): ``()`` for GitHub's own reads,
#: else the sorted namespaces of the pools whose webhook secret verified its deliveries.
Origin = tuple[str, ...]
GITHUB: Origin = ()


@dataclass(frozen=True, slots=True)
class PoolScope:
    """A pool as job routing needs it: key (with labels), its scope (org or owner/name), the
    installation of its credentials once GitHub accepted them (``installation``; None: not
    proven yet, so it is routed nothing), that installation's id (``installation_id``: App
    credentials; None for a PAT), its runners' name prefix (``prefix``) and whether it is
    routed queued jobs at all (``takes_jobs``: False for a ``manual`` pool, whose demand is its
    minIdle and its demand annotation only, so it never takes a job from a pool that observes
    them)."""

    key: PoolLabels
    org: str | None = None
    repo: str | None = None
    installation: str | None = ""
    installation_id: int | None = None
    prefix: str = ""
    takes_jobs: bool = True

    def covers(self, repository: str) -> bool:
        """Whether a job of ``repository`` (``owner/name``) may run on this pool's runners."""
        if self.repo is not None:
            return self.repo.casefold() == repository.casefold()
        owner = repository.split("/", 1)[0]
        return self.org is not None and self.org.casefold() == owner.casefold()

    def could_own(self, job: Job) -> bool:
        """Whether this pool could run ``job``: the job's installation is the pool's, its
        repository is in the pool's scope and its labels match the pool's."""
        return (
            self.installation is not None
            and self.installation == job.installation
            and self.covers(job.repository)
            and job_matches(job.labels, self.key.labels)
        )

    def owns_runner(self, name: str) -> bool:
        """Whether ``name`` is one of this pool's runners."""
        return bool(self.prefix) and owns_runner_name(self.prefix, name)


@dataclass(frozen=True, slots=True)
class Job:
    """One workflow job. ``status``: queued, waiting, in_progress (``runner_name`` set once a
    runner took it) or completed. ``installation``: the table it belongs to."""

    id: int
    run_id: int
    repository: str
    labels: tuple[str, ...]
    status: str
    seen_at: datetime
    runner_name: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    #: ``(namespace, name)`` of the pools a webhook delivery may feed (those whose webhook
    #: secret verified it); None = any pool of the installation (GitHub's own answer, a poll)
    allowed: frozenset[tuple[str, str]] | None = None
    installation: str = ""

    @property
    def queued(self) -> bool:
        return RANK.get(self.status, 0) == 0

    @property
    def origin(self) -> Origin:
        """What this job counts against (see the module docstring)."""
        if self.allowed is None:
            return GITHUB
        return tuple(sorted({ns for ns, _ in self.allowed}))

    @property
    def wait_seconds(self) -> float | None:
        """Seconds from queued (when impvm first saw it) to in progress (GitHub's
        ``started_at``); None until it started. Never negative: a job first seen already in
        progress waited 0 as far as impvm knows."""
        if self.started_at is None:
            return None
        return max(0.0, (self.started_at - self.seen_at).total_seconds())


@dataclass(frozen=True, slots=True)
class Arrival:
    """A job first recorded queued: its number in the arrival log (``seq``, from 1, in the
    order recorded) and when it was observed (``at``: the job's ``seen_at``; a poll stamps the
    time it started, so ``at`` is not ordered like ``seq``)."""

    seq: int
    at: datetime


def candidates(job: Job, pools: Sequence[PoolScope]) -> list[PoolLabels]:
    """The pools ``job`` may be routed to: those taking jobs of its installation, covering its
    repository, and (for a job only deliveries told of) among those whose secret verified
    them."""
    return [
        p.key
        for p in pools
        if p.takes_jobs
        and p.installation is not None
        and p.installation == job.installation
        and p.covers(job.repository)
        and (job.allowed is None or (p.key.namespace, p.key.name) in job.allowed)
    ]


def route(job: Job, pools: Sequence[PoolScope]) -> PoolLabels | None:
    """The pool ``job`` belongs to (None: no pool matches; counted as unmatched)."""
    return choose_pool(job.labels, candidates(job, pools))


def concerned(job: Job, pools: Sequence[PoolScope]) -> frozenset[PoolKey]:
    """The pools whose next pass a change of ``job`` (as the table now records it) concerns,
    so they are woken rather than left to their next tick: the pool it belongs to
    (:func:`route`), and the pools whose runner it names (it runs or ran there), of those its
    record allows (``job.allowed``; None: GitHub's own read, any pool)."""
    out: set[PoolKey] = set()
    pool = route(job, pools)
    if pool is not None:
        out.add(pool.key)
    if job.runner_name:
        for scope in pools:
            key = scope.key.key
            allowed = job.allowed is None or (key.namespace, key.name) in job.allowed
            if allowed and scope.owns_runner(job.runner_name):
                out.add(key)
    return frozenset(out)


def tied(job: Job, pools: Sequence[PoolScope]) -> tuple[PoolLabels, ...]:
    """The pools that fit ``job`` equally well when more than one does (the first is the one
    :func:`route` chose: the oldest), else ``()``."""
    best = fitting_pools(job.labels, candidates(job, pools))
    return tuple(best) if len(best) > 1 else ()
