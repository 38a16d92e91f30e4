"""GitHub-shaped JSON of the stand-in's workflow runs and jobs and its ``workflow_job`` webhook
payloads (keys as in ``@octokit/webhooks-examples``).

Shapes follow GitHub's REST OpenAPI description (checked in tests with githubkit's models).
"""

from __future__ import annotations

from typing import Any

from impvm.devstack.standin.records import JobRec, RunRec
from impvm.devstack.standin.shapes import Shapes, iso, node_id


class RunShapes(Shapes):
    """Runs, jobs and webhook payloads, over :class:`Shapes` (users and repositories)."""

    def workflow_run(self, run: RunRec) -> dict[str, Any]:
        repo = self.repos[run.repo]
        u = self.api(f"/repos/{run.repo}/actions/runs/{run.id}")
        commit_author = {"name": "Octo Cat", "email": "octocat@example.com"}
        return {
            "id": run.id,
            "name": run.name,
            "node_id": node_id("WorkflowRun", run.id),
            "check_suite_id": run.id + 1,
            "check_suite_node_id": node_id("CheckSuite", run.id + 1),
            "head_branch": run.head_branch,
            "head_sha": run.head_sha,
            "path": ".github/workflows/ci.yml",
            "run_number": run.run_number,
            "run_attempt": run.run_attempt,
            "event": run.event,
            "display_title": run.name,
            "status": run.status,
            "conclusion": run.conclusion,
            "workflow_id": run.workflow_id,
            "url": u,
            "html_url": f"https://github.com/{run.repo}/actions/runs/{run.id}",
            "pull_requests": [],
            "created_at": iso(run.created_at),
            "updated_at": iso(run.updated_at),
            "run_started_at": iso(run.created_at),
            "actor": self.user(repo.owner),
            "triggering_actor": self.user(repo.owner),
            "jobs_url": f"{u}/jobs",
            "logs_url": f"{u}/logs",
            "check_suite_url": self.api(f"/repos/{run.repo}/check-suites/{run.id + 1}"),
            "artifacts_url": f"{u}/artifacts",
            "cancel_url": f"{u}/cancel",
            "rerun_url": f"{u}/rerun",
            "previous_attempt_url": None,
            "workflow_url": self.api(f"/repos/{run.repo}/actions/workflows/{run.workflow_id}"),
            "head_commit": {
                "id": run.head_sha,
                "tree_id": run.head_sha,
                "message": "stand-in commit",
                "timestamp": iso(run.created_at),
                "author": commit_author,
                "committer": commit_author,
            },
            "repository": self.repository(repo),
            "head_repository": self.repository(repo),
        }

    def job(self, job: JobRec) -> dict[str, Any]:
        u = self.api(f"/repos/{job.repo}/actions/jobs/{job.id}")
        steps = []
        if job.status != "queued":
            steps.append(
                {
                    "name": "Run job",
                    "status": job.status,
                    "conclusion": job.conclusion,
                    "number": 1,
                    "started_at": iso(job.started_at),
                    "completed_at": iso(job.completed_at),
                }
            )
        return {
            "id": job.id,
            "run_id": job.run_id,
            "run_url": self.api(f"/repos/{job.repo}/actions/runs/{job.run_id}"),
            "run_attempt": job.run_attempt,
            "node_id": node_id("CheckRun", job.id),
            "head_sha": job.head_sha,
            "url": u,
            "html_url": f"https://github.com/{job.repo}/actions/runs/{job.run_id}/job/{job.id}",
            "status": job.status,
            "conclusion": job.conclusion,
            "created_at": iso(job.created_at),
            "started_at": iso(job.started_at or job.created_at),
            "completed_at": iso(job.completed_at),
            "name": job.name,
            "steps": steps,
            "check_run_url": self.api(f"/repos/{job.repo}/check-runs/{job.id}"),
            "labels": job.labels,
            "runner_id": job.runner_id,
            "runner_name": job.runner_name,
            "runner_group_id": job.runner_group_id,
            "runner_group_name": job.runner_group_name,
            "workflow_name": job.workflow_name,
            "head_branch": job.head_branch,
        }

    def workflow_job_payload(
        self, action: str, job: JobRec, installation_id: int | None
    ) -> dict[str, Any]:
        """A ``workflow_job`` webhook payload (keys as in ``@octokit/webhooks-examples``)."""
        repo = self.repos[job.repo]
        payload: dict[str, Any] = {
            "action": action,
            "workflow_job": self.job(job),
            "repository": {**self.repository(repo), "custom_properties": {}},
            "sender": self.user(repo.owner),
        }
        if repo.owner in self.orgs:
            org = self.orgs[repo.owner]
            u = self.api(f"/orgs/{org.login}")
            payload["organization"] = {
                "login": org.login,
                "id": org.id,
                "node_id": node_id("Organization", org.id),
                "url": u,
                "repos_url": f"{u}/repos",
                "events_url": f"{u}/events",
                "hooks_url": f"{u}/hooks",
                "issues_url": f"{u}/issues",
                "members_url": f"{u}/members{{/member}}",
                "public_members_url": f"{u}/public_members{{/member}}",
                "avatar_url": f"https://avatars.githubusercontent.com/u/{org.id}?v=4",
                "description": None,
            }
        if installation_id is not None:
            payload["installation"] = {
                "id": installation_id,
                "node_id": node_id("Installation", installation_id),
            }
        return payload
