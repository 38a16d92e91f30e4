"""Reading one repository's pending demand from GitHub, with conditional requests throughout
(for :class:`impvm.operator.poller.InstallationPoller`, one per installation).

GitHub has no org-wide job queue endpoint: per repository the ``queued`` and ``in_progress``
runs are listed (REST "Workflow runs": list workflow runs for a repository with ``status``),
then the jobs of each run (REST "Workflow jobs": list jobs for a workflow run); an org's
repositories come from the installation's listing (REST "Installations"). Every read is
conditional (``If-None-Match`` with the last ETag, in :class:`impvm.github.GitHubClient`): a 304
costs no rate limit (REST "Best practices for using the REST API"). Beyond that, nothing is read
that cannot have changed:

- both run listings 304: the repository's jobs are the last answer's, no jobs read at all;
- a listing changed: the jobs of a run are read again only when the run itself changed
  (another ``updated_at``, status or attempt) or its last answer still had a queued job (a job
  of a multi-job run can start while the run stays ``in_progress``); the others are kept.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from impvm.github import GitHubClient, Scope, WorkflowJob, WorkflowRun
from impvm.github.errors import NotFound
from impvm.github.types import RunStatus
from impvm.scaling.jobs import Job

#: the run statuses a poll lists (a run's jobs are queued or in progress only in these)
OPEN_RUN_STATUSES: tuple[RunStatus, ...] = ("queued", "in_progress")


def job_from_github(job: WorkflowJob, repository: str, now: dt.datetime) -> Job:
    """A job-table entry from a REST workflow job."""
    return Job(
        id=job.id,
        run_id=job.run_id,
        repository=repository,
        labels=tuple(job.labels),
        status=job.status,
        seen_at=now,
        runner_name=job.runner_name,
        started_at=job.started_at if job.status != "queued" else None,
        completed_at=job.completed_at,
    )


@dataclass(frozen=True, slots=True)
class RepoMemory:
    """The last answer for one repository: its open runs by id and each run's jobs."""

    runs: dict[int, WorkflowRun] = field(default_factory=dict)
    jobs: dict[int, tuple[WorkflowJob, ...]] = field(default_factory=dict)

    @property
    def open_runs(self) -> int:
        return len(self.runs)


@dataclass(frozen=True, slots=True)
class RepoRead:
    """One repository read completely: its jobs (as of ``now``), the requests made and how many
    were 304s, the answer to keep for the next read, and whether GitHub no longer has it."""

    repository: str
    jobs: tuple[Job, ...]
    calls: int
    not_modified: int
    memory: RepoMemory
    gone: bool = False
    #: of ``calls``, the run listings (pages): what the next read costs when nothing changed
    listing_calls: int = 0


def _has_queued(jobs: tuple[WorkflowJob, ...]) -> bool:
    return any(j.status in ("queued", "waiting") for j in jobs)


async def read_repo(
    github: GitHubClient, repo: str, kept: RepoMemory | None, now: dt.datetime
) -> RepoRead:
    """Read ``repo``'s open runs and their jobs, reusing ``kept`` (the last answer) where GitHub
    says nothing changed (see the module docstring). A repository GitHub no longer has (404) is
    read completely: no jobs. Raises :class:`impvm.github.errors.GitHubError` otherwise."""
    calls = not_modified = 0
    runs: dict[int, WorkflowRun] = {}
    unchanged = True
    try:
        for status in OPEN_RUN_STATUSES:
            listed = await github.read_runs(repo, status)
            calls += listed.calls
            not_modified += listed.not_modified
            unchanged = unchanged and listed.unchanged
            for run in listed.items:
                runs.setdefault(run.id, run)  # a run that moved between the two reads: once
    except NotFound:
        return RepoRead(repo, (), calls + 1, not_modified, RepoMemory(), gone=True)
    listing_calls = calls
    jobs: dict[int, tuple[WorkflowJob, ...]] = {}
    if kept is not None and unchanged:
        jobs = {i: kept.jobs[i] for i in runs if i in kept.jobs}
    for run_id, run in runs.items():
        if run_id in jobs:
            continue
        before = kept.jobs.get(run_id) if kept is not None else None
        if (
            kept is not None
            and before is not None
            and kept.runs.get(run_id) == run
            and not _has_queued(before)
        ):
            jobs[run_id] = before
            continue
        try:
            listed_jobs = await github.read_run_jobs(repo, run_id)
        except NotFound:  # the run was deleted since it was listed
            calls += 1
            continue
        calls += listed_jobs.calls
        not_modified += listed_jobs.not_modified
        jobs[run_id] = tuple(listed_jobs.items)
    memory = RepoMemory({i: r for i, r in runs.items() if i in jobs}, jobs)
    found = tuple(job_from_github(j, repo, now) for js in jobs.values() for j in js)
    return RepoRead(repo, found, calls, not_modified, memory, listing_calls=listing_calls)


def scope_repositories(scope: Scope, installation: list[str]) -> list[str]:
    """``owner/name`` of the repositories whose jobs a pool of ``scope`` may run, from the
    installation's repositories (a repository scope: that one, listed or not)."""
    if scope.repo is not None:
        return [scope.repo]
    org = (scope.org or "").casefold()
    return [r for r in installation if r.split("/", 1)[0].casefold() == org]
