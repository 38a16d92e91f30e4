"""Pending demand from polling GitHub (scaling.mode polling/hybrid).

GitHub has no org-wide job queue endpoint: for an org scope the installation's repositories are
listed, then each repository's queued runs and their jobs (REST "Workflow runs": list workflow
runs for a repository with ``status=queued``; "Workflow jobs": list jobs for a workflow run).
Repeated reads are conditional (ETag), so an unchanged queue costs no rate limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from impvm.github import GitHubClient, Scope
from impvm.scaling.labels import job_matches


async def repositories(github: GitHubClient, scope: Scope) -> list[str]:
    """``owner/name`` of every repository whose jobs the pool may run."""
    if scope.repo is not None:
        return [scope.repo]
    return [r.full_name for r in await github.list_installation_repos() if r.owner == scope.org]


async def poll_queued_jobs(github: GitHubClient, scope: Scope, labels: Sequence[str]) -> int:
    """Number of queued workflow jobs whose labels this pool satisfies (not runs: a run may
    hold many jobs, and jobs for other pools). Raises :class:`impvm.github.errors.GitHubError`."""
    count = 0
    for repo in await repositories(github, scope):
        for run in await github.list_runs(repo, "queued"):
            for job in await github.list_run_jobs(repo, run.id):
                if job.status == "queued" and job_matches(job.labels, labels):
                    count += 1
    return count
