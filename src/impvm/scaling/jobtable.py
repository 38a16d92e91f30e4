"""The job table: what the operator knows of workflow jobs, fed by webhooks and polling.

Pure and in-memory (no I/O, time is an argument): after a restart it is rebuilt from GitHub (a
poll) and from ``ImpVM.status.job`` (docs/architecture.md: in-memory state is a cache).

Rules:

- a job's state only moves forward: queued/waiting → in_progress → completed; a delivery that
  would move it back (GitHub does not guarantee order) changes nothing;
- deliveries are deduplicated by ``X-GitHub-Delivery`` (bounded memory);
- a job belongs to at most one pool: the pools whose scope covers its repository and whose labels
  it matches, then :func:`impvm.scaling.labels.choose_pool` (tightest fit, deterministic);
- pending demand of a pool = its queued jobs not yet assigned a runner;
- completed jobs are dropped (a tombstone remembers them so a late delivery cannot resurrect
  them); a queued or in-progress job that a complete poll shows completed or gone is dropped
  (stale-job sweep: its ``completed`` delivery was lost, so it would stay forever);
- every job first recorded queued is an arrival (:class:`Arrival`, numbered in the order
  recorded), what the warm pool's arrival rate counts (:mod:`impvm.scaling.warmpool`); a job
  first seen already in progress (taken before we saw it, or open across an operator restart)
  is none, so a restart does not count the running jobs again (the ones still queued it does:
  the table is rebuilt from a poll).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from impvm.scaling.labels import PoolLabels, choose_pool

#: Rank of each GitHub job status; ``waiting`` (environment protection) is still queued for us.
_RANK = {"queued": 0, "waiting": 0, "in_progress": 1, "completed": 2}


@dataclass(frozen=True, slots=True)
class PoolScope:
    """A pool as job routing needs it: key (with labels) and its scope (org or owner/name)."""

    key: PoolLabels
    org: str | None = None
    repo: str | None = None

    def covers(self, repository: str) -> bool:
        """Whether a job of ``repository`` (``owner/name``) may run on this pool's runners."""
        if self.repo is not None:
            return self.repo.casefold() == repository.casefold()
        owner = repository.split("/", 1)[0]
        return self.org is not None and self.org.casefold() == owner.casefold()


@dataclass(frozen=True, slots=True)
class Job:
    """One workflow job. ``status``: queued, waiting, in_progress (``runner_name`` set once a
    runner took it) or completed."""

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
    #: secret verified it); None = any pool (GitHub's own answer, from a poll)
    allowed: frozenset[tuple[str, str]] | None = None

    @property
    def queued(self) -> bool:
        return _RANK.get(self.status, 0) == 0

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
    """A job first recorded queued: its number in the table's arrival log (``seq``, from 1, in
    the order recorded) and when it was observed (``at``: the job's ``seen_at``; a poll stamps
    the time it started, so ``at`` is not ordered like ``seq``)."""

    seq: int
    at: datetime


def route(job: Job, pools: Sequence[PoolScope]) -> PoolLabels | None:
    """The pool ``job`` belongs to (None: no pool matches; counted as unmatched)."""
    candidates = [
        p.key
        for p in pools
        if p.covers(job.repository)
        and (job.allowed is None or (p.key.namespace, p.key.name) in job.allowed)
    ]
    return choose_pool(job.labels, candidates)


@dataclass
class JobTable:
    """Jobs by id, plus bounded memories of seen deliveries and completed jobs."""

    max_remembered: int = 10000
    jobs: dict[int, Job] = field(default_factory=dict)
    _deliveries: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _completed: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _arrivals: deque[tuple[Arrival, Job]] = field(default_factory=deque)
    _arrived: int = 0

    def seen_delivery(self, delivery_id: str | None) -> bool:
        """Record a delivery id; True when it was seen before (a redelivery: ignore it)."""
        if not delivery_id:
            return False
        if delivery_id in self._deliveries:
            return True
        self._remember(self._deliveries, delivery_id)
        return False

    def _remember(self, memory: OrderedDict[str, None] | OrderedDict[int, None], k: object) -> None:
        memory[k] = None  # type: ignore[index]
        while len(memory) > self.max_remembered:
            memory.popitem(last=False)

    def apply(self, job: Job) -> Job | None:
        """Apply one observation of a job (from a webhook or a poll). Returns the job as now
        recorded, or None when the observation changed nothing (stale, duplicate, or a job
        already completed)."""
        if job.id in self._completed:
            return None
        old = self.jobs.get(job.id)
        rank = _RANK.get(job.status)
        if rank is None:
            return None
        if old is not None:
            old_rank = _RANK[old.status]
            widened = old.allowed is not None and job.allowed != old.allowed
            if rank < old_rank or (
                rank == old_rank and job.runner_name in (None, old.runner_name) and not widened
            ):
                return None
            job = replace(
                job,
                seen_at=old.seen_at,
                allowed=None
                if job.allowed is None or old.allowed is None
                else old.allowed | job.allowed,
                labels=job.labels or old.labels,
                runner_name=job.runner_name or old.runner_name,
                started_at=job.started_at or old.started_at,
            )
        if rank == 2:
            self.jobs.pop(job.id, None)
            self._remember(self._completed, job.id)
            return job
        if old is None and rank == 0:
            self._arrived += 1
            self._arrivals.append((Arrival(self._arrived, job.seen_at), job))
            while len(self._arrivals) > self.max_remembered:
                self._arrivals.popleft()
        self.jobs[job.id] = job
        return job

    def arrivals(self, pool: PoolLabels, pools: Sequence[PoolScope], after: int) -> list[Arrival]:
        """The arrivals numbered above ``after`` that are routed to ``pool`` (in ``seq``
        order; the log keeps the last ``max_remembered``)."""
        out: list[Arrival] = []
        for a, job in reversed(self._arrivals):  # newest first: stop at the first one read
            if a.seq <= after:
                break
            if route(self.jobs.get(job.id, job), pools) == pool:
                out.append(a)
        out.reverse()
        return out

    @property
    def last_arrival(self) -> int:
        """``seq`` of the latest arrival (0: none yet)."""
        return self._arrived

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
        """Stale-job sweep after a complete poll of ``repositories``: drop queued jobs of those
        repositories that the poll did not see queued, and — when the poll also listed the
        running jobs (``still_running``: ids it saw queued or in progress) — in-progress jobs it
        did not see (their run finished and the ``completed`` delivery was lost). Only jobs
        recorded before the poll started (``before``) are dropped: a job a webhook recorded
        during the poll is kept. Dropped in-progress jobs are remembered as completed, so a late
        delivery cannot bring them back. Returns the ids dropped."""
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
            if not self.jobs.pop(i).queued:
                self._remember(self._completed, i)
        return dropped
