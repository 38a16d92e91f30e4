"""GitHub-shaped JSON of the stand-in's users, repositories, runners and runner groups, and the
JIT config it hands out.

Shapes follow GitHub's REST OpenAPI description (checked in tests with githubkit's models).
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from impvm.devstack.standin.records import Org, Repo, RunnerGroup, RunnerRec


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> GitHub's ``YYYY-MM-DDTHH:MM:SSZ`` (``None`` stays ``None``)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_id(kind: str, ident: int) -> str:
    """An opaque GitHub-like node id."""
    return base64.b64encode(f"0:{kind}{ident}".encode()).decode().rstrip("=")


class Shapes:
    """The renderings :class:`~impvm.devstack.standin.state.StandInState` inherits: the
    attributes below are its fields."""

    base_url: str
    runner_base_url: str | None
    orgs: dict[str, Org]
    repos: dict[str, Repo]
    runner_groups: dict[int, RunnerGroup]

    def api(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def user(self, login: str) -> dict[str, Any]:
        org = self.orgs.get(login)
        ident = org.id if org else 1
        u = self.api(f"/users/{login}")
        return {
            "login": login,
            "id": ident,
            "node_id": node_id("Organization", ident),
            "avatar_url": f"https://avatars.githubusercontent.com/u/{ident}?v=4",
            "gravatar_id": "",
            "url": u,
            "html_url": f"https://github.com/{login}",
            "followers_url": f"{u}/followers",
            "following_url": f"{u}/following{{/other_user}}",
            "gists_url": f"{u}/gists{{/gist_id}}",
            "starred_url": f"{u}/starred{{/owner}}{{/repo}}",
            "subscriptions_url": f"{u}/subscriptions",
            "organizations_url": f"{u}/orgs",
            "repos_url": f"{u}/repos",
            "events_url": f"{u}/events{{/privacy}}",
            "received_events_url": f"{u}/received_events",
            "type": "Organization" if org else "User",
            "user_view_type": "public",
            "site_admin": False,
        }

    def repository(self, repo: Repo) -> dict[str, Any]:
        """Full repository shape (``repository`` / ``minimal-repository`` / webhook repo)."""
        u = self.api(f"/repos/{repo.full_name}")
        templated = {
            "archive_url": "/{archive_format}{/ref}",
            "assignees_url": "/assignees{/user}",
            "blobs_url": "/git/blobs{/sha}",
            "branches_url": "/branches{/branch}",
            "collaborators_url": "/collaborators{/collaborator}",
            "comments_url": "/comments{/number}",
            "commits_url": "/commits{/sha}",
            "compare_url": "/compare/{base}...{head}",
            "contents_url": "/contents/{+path}",
            "contributors_url": "/contributors",
            "deployments_url": "/deployments",
            "downloads_url": "/downloads",
            "events_url": "/events",
            "forks_url": "/forks",
            "git_commits_url": "/git/commits{/sha}",
            "git_refs_url": "/git/refs{/sha}",
            "git_tags_url": "/git/tags{/sha}",
            "hooks_url": "/hooks",
            "issue_comment_url": "/issues/comments{/number}",
            "issue_events_url": "/issues/events{/number}",
            "issues_url": "/issues{/number}",
            "keys_url": "/keys{/key_id}",
            "labels_url": "/labels{/name}",
            "languages_url": "/languages",
            "merges_url": "/merges",
            "milestones_url": "/milestones{/number}",
            "notifications_url": "/notifications{?since,all,participating}",
            "pulls_url": "/pulls{/number}",
            "releases_url": "/releases{/id}",
            "stargazers_url": "/stargazers",
            "statuses_url": "/statuses/{sha}",
            "subscribers_url": "/subscribers",
            "subscription_url": "/subscription",
            "tags_url": "/tags",
            "teams_url": "/teams",
            "trees_url": "/git/trees{/sha}",
        }
        created = "2024-01-01T00:00:00Z"
        out: dict[str, Any] = {
            "id": repo.id,
            "node_id": node_id("Repository", repo.id),
            "name": repo.name,
            "full_name": repo.full_name,
            "private": repo.private,
            "owner": self.user(repo.owner),
            "html_url": f"https://github.com/{repo.full_name}",
            "description": None,
            "fork": False,
            "url": u,
            **{k: u + v for k, v in templated.items()},
            "git_url": f"git://github.com/{repo.full_name}.git",
            "ssh_url": f"git@github.com:{repo.full_name}.git",
            "clone_url": f"https://github.com/{repo.full_name}.git",
            "svn_url": f"https://github.com/{repo.full_name}",
            "mirror_url": None,
            "homepage": None,
            "language": None,
            "license": None,
            "forks": 0,
            "forks_count": 0,
            "stargazers_count": 0,
            "watchers_count": 0,
            "watchers": 0,
            "size": 0,
            "default_branch": "main",
            "open_issues_count": 0,
            "open_issues": 0,
            "is_template": False,
            "topics": [],
            "has_issues": True,
            "has_projects": False,
            "has_wiki": False,
            "has_pages": False,
            "has_downloads": False,
            "has_discussions": False,
            "archived": False,
            "disabled": False,
            "visibility": "private" if repo.private else "public",
            "pushed_at": created,
            "created_at": created,
            "updated_at": created,
            "allow_forking": False,
            "web_commit_signoff_required": False,
        }
        return out

    def runner(self, r: RunnerRec) -> dict[str, Any]:
        return {
            "id": r.id,
            "runner_group_id": r.group_id,
            "name": r.name,
            "os": r.os,
            "status": r.status,
            "busy": r.busy,
            "ephemeral": r.ephemeral,
            "labels": [
                {"id": i + 1, "name": label, "type": "custom"} for i, label in enumerate(r.labels)
            ],
        }

    def runner_group(self, g: RunnerGroup) -> dict[str, Any]:
        u = self.api(f"/orgs/{g.org}/actions/runner-groups/{g.id}")
        return {
            "id": g.id,
            "name": g.name,
            "visibility": g.visibility,
            "default": g.default,
            "runners_url": f"{u}/runners",
            "hosted_runners_url": f"{u}/hosted-runners",
            "inherited": False,
            "allows_public_repositories": False,
            "restricted_to_workflows": False,
            "selected_workflows": [],
            "workflow_restrictions_read_only": False,
        }

    def jit_config(self, runner: RunnerRec) -> str:
        """Opaque JIT config: base64 of JSON like GitHub's (``.runner``, ``.credentials``,
        ``.credentials_rsaparams``, each base64 JSON). ``.runner.serverUrl`` is the stand-in's
        runner endpoint; ``.credentials.data.token`` the session token."""

        def b64(obj: Any) -> str:
            return base64.b64encode(json.dumps(obj).encode()).decode()

        scope = runner.org or runner.repo or ""
        runner_file = {
            "agentId": runner.id,
            "agentName": runner.name,
            "poolId": runner.group_id,
            "poolName": self.runner_groups.get(runner.group_id, RunnerGroup(1, "", "Default")).name,
            "serverUrl": (self.runner_base_url or self.base_url).rstrip("/") + "/_standin/runner",
            "gitHubUrl": f"https://github.com/{scope}",
            "workFolder": runner.work_folder,
            "ephemeral": True,
            "disableUpdate": True,
        }
        credentials = {"scheme": "OAuth", "data": {"token": runner.session_token}}
        digest = hashlib.sha256(runner.session_token.encode()).hexdigest()
        return b64(
            {
                ".runner": b64(runner_file),
                ".credentials": b64(credentials),
                ".credentials_rsaparams": b64({"kid": digest[:16]}),
            }
        )
