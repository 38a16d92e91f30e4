"""Pending demand from polling GitHub (``scaling.mode`` polling/hybrid, and once at start-up in
webhook mode so a restart loses no job).

GitHub has no org-wide job queue endpoint: for an org scope the installation's repositories are
listed, then each repository's queued and in-progress runs and their jobs (REST "Workflow runs":
list workflow runs for a repository with ``status``; "Workflow jobs": list jobs for a workflow
run). Repeated reads are conditional (ETag, in :class:`impvm.github.GitHubClient`), so an
unchanged queue costs no rate limit.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from impvm.github import GitHubClient, Scope, WorkflowJob
from impvm.scaling.jobtable import Job


@dataclass
class PollResult:
    """One complete poll: every job seen, the repositories read, and what it cost (requests)."""

    started_at: dt.datetime
    repositories: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    api_calls: int = 0

    @property
    def queued_ids(self) -> set[int]:
        """Ids of jobs GitHub reported queued."""
        return {j.id for j in self.jobs if j.queued}

    @property
    def open_ids(self) -> set[int]:
        """Ids of jobs GitHub reported queued or in progress."""
        return {j.id for j in self.jobs if j.status != "completed"}


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


async def repositories(github: GitHubClient, scope: Scope) -> list[str]:
    """``owner/name`` of every repository whose jobs the pool may run."""
    if scope.repo is not None:
        return [scope.repo]
    return [
        r.full_name
        for r in await github.list_installation_repos()
        if r.owner.casefold() == (scope.org or "").casefold()
    ]


async def poll_jobs(github: GitHubClient, scope: Scope, now: dt.datetime) -> PollResult:
    """Read every queued and in-progress job of the scope's repositories (jobs, not runs: a run
    holds many jobs, some for other pools); ``now`` is when the poll starts. Raises
    :class:`impvm.github.errors.GitHubError`."""
    result = PollResult(started_at=now)
    result.repositories = await repositories(github, scope)
    result.api_calls += 1 if scope.repo is None else 0
    for repo in result.repositories:
        for status in ("queued", "in_progress"):
            runs = await github.list_runs(repo, status)
            result.api_calls += 1
            for run in runs:
                jobs = await github.list_run_jobs(repo, run.id)
                result.api_calls += 1
                result.jobs.extend(job_from_github(j, repo, now) for j in jobs)
    return result
