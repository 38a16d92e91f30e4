"""State of the GitHub stand-in and the GitHub-shaped JSON it renders.

Shapes follow GitHub's REST OpenAPI description (checked in tests with githubkit's models):
runners, runner groups, workflow runs, jobs, repositories, users, webhook payloads
(``workflow_job``, shaped like ``@octokit/webhooks-examples``).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

LEVELS = {"read": 1, "write": 2, "admin": 3}
DOCS = "https://docs.github.com/rest"


def _public_key(pem: str) -> RSAPublicKey:
    """An RSA public key from a public or private key PEM (the public part of the latter)."""
    data = pem.encode()
    key: Any
    if b"PRIVATE KEY" in data:
        key = serialization.load_pem_private_key(data, password=None).public_key()
    else:
        key = serialization.load_pem_public_key(data)
    if not isinstance(key, RSAPublicKey):
        raise ValueError("app key must be RSA")
    return key


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> GitHub's ``YYYY-MM-DDTHH:MM:SSZ`` (``None`` stays ``None``)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_id(kind: str, ident: int) -> str:
    """An opaque GitHub-like node id."""
    return base64.b64encode(f"0:{kind}{ident}".encode()).decode().rstrip("=")


@dataclass
class App:
    id: int
    slug: str
    public_key: RSAPublicKey
    #: further keys GitHub accepts for the App (an App may have several private keys at once,
    #: "Managing private keys for GitHub Apps": how a key is rotated without downtime)
    more_keys: list[RSAPublicKey] = field(default_factory=list)

    @property
    def keys(self) -> list[RSAPublicKey]:
        return [self.public_key, *self.more_keys]


@dataclass
class Installation:
    id: int
    app_id: int
    account: str
    permissions: dict[str, str]
    suspended: bool = False
    removed: bool = False


@dataclass
class Org:
    login: str
    id: int


@dataclass
class Repo:
    id: int
    owner: str
    name: str
    private: bool = True

    @property
    def full_name(self) -> str:
        return f"{self.owner}/{self.name}"


@dataclass
class RunnerGroup:
    id: int
    org: str
    name: str
    default: bool = False
    visibility: str = "all"


@dataclass
class RunnerRec:
    id: int
    name: str
    labels: list[str]
    group_id: int
    org: str | None
    repo: str | None
    session_token: str
    work_folder: str
    status: str = "offline"
    busy: bool = False
    job_id: int | None = None
    os: str = "Linux"
    ephemeral: bool = True
    #: epoch seconds of the runner's last contact (session, acquire, heartbeat, complete)
    last_seen: float = 0.0


@dataclass
class TokenRec:
    token: str
    installation_id: int | None
    account: str
    permissions: dict[str, str]
    expires_at: float


@dataclass
class RunRec:
    id: int
    repo: str
    name: str
    workflow_id: int
    run_number: int
    created_at: float
    updated_at: float
    status: str = "queued"
    conclusion: str | None = None
    run_attempt: int = 1
    head_branch: str = "main"
    head_sha: str = "0" * 40
    event: str = "push"


@dataclass
class JobRec:
    id: int
    run_id: int
    repo: str
    name: str
    labels: list[str]
    created_at: float
    workflow_name: str
    command: list[str] | None = None
    sleep_seconds: float = 0.0
    status: str = "queued"
    conclusion: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    runner_id: int | None = None
    runner_name: str | None = None
    runner_group_id: int | None = None
    runner_group_name: str | None = None
    head_branch: str = "main"
    head_sha: str = "0" * 40
    run_attempt: int = 1


@dataclass
class Failure:
    """An injected failure for the next ``count`` matching API requests.

    ``kind``: ``status`` (respond ``status`` with ``message``), ``timeout`` (delay ``delay`` s
    before answering normally), ``primary_rate_limit`` (403, remaining 0, reset in
    ``reset_in`` s), ``secondary_rate_limit`` (403 with ``retry-after`` if ``retry_after``
    is set, else without), ``suspend`` (403 installation suspended).

    ``probability`` (0..1): the share of matching requests that fail (each draws at random; one
    that does not fail leaves ``count`` as it was), for a GitHub that fails some calls rather
    than the next few."""

    kind: str
    count: int = 1
    method: str | None = None
    path: str | None = None
    status: int = 502
    message: str = "Server Error"
    delay: float = 0.0
    retry_after: int | None = None
    reset_in: int = 60
    probability: float = 1.0


@dataclass
class RateBucket:
    limit: int = 5000
    remaining: int = 5000
    reset: float = 0.0


@dataclass
class Delivery:
    id: str
    event: str
    action: str
    status: int | None
    error: str | None = None


@dataclass
class WebhookTarget:
    url: str
    secret: str
    #: fraction of deliveries silently lost (tests of webhook loss), 0..1
    drop_rate: float = 0.0
    #: the App whose webhook this is: it receives only the events of that App's installations
    #: (None: every event, like an organisation webhook of every org)
    app_id: int | None = None


@dataclass
class StandInState:
    """Everything the stand-in knows. Seed with :meth:`seed` (a JSON-able document) or the
    ``add_*`` methods. Times are epoch seconds."""

    base_url: str = "http://127.0.0.1"
    #: seconds without contact after which an online runner is offline, and the job it was
    #: running fails (GitHub: the runner lost communication with the server)
    runner_timeout: float = 30.0
    #: base URL runners use (the JIT config's serverUrl), when it differs from ``base_url``:
    #: a QEMU guest reaches the host's loopback as 10.0.2.2
    runner_base_url: str | None = None
    token_ttl: float = 3600.0
    apps: dict[int, App] = field(default_factory=dict)
    installations: dict[int, Installation] = field(default_factory=dict)
    orgs: dict[str, Org] = field(default_factory=dict)
    repos: dict[str, Repo] = field(default_factory=dict)
    runner_groups: dict[int, RunnerGroup] = field(default_factory=dict)
    runners: dict[int, RunnerRec] = field(default_factory=dict)
    tokens: dict[str, TokenRec] = field(default_factory=dict)
    pats: dict[str, TokenRec] = field(default_factory=dict)
    runs: dict[int, RunRec] = field(default_factory=dict)
    jobs: dict[int, JobRec] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    buckets: dict[str, RateBucket] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    webhooks: list[WebhookTarget] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    def next_id(self) -> int:
        return next(self.ids)

    # ------------------------------------------------------------------ seeding

    def add_app(self, app_id: int, public_key_pem: str, slug: str = "impvm-test") -> App:
        """Register an App by its public key (PEM), or a private key PEM (public part used)."""
        app = App(app_id, slug, _public_key(public_key_pem))
        self.apps[app_id] = app
        return app

    def add_app_key(self, app_id: int, public_key_pem: str) -> None:
        """Give an App another key (GitHub: "Generate a private key" beside the old one)."""
        self.apps[app_id].more_keys.append(_public_key(public_key_pem))

    def revoke_app_key(self, app_id: int, public_key_pem: str) -> None:
        """Delete one of an App's keys (GitHub: deleting a private key); another stays."""
        app = self.apps[app_id]
        gone = _public_key(public_key_pem).public_numbers()
        keys = [k for k in app.keys if k.public_numbers() != gone]
        if not keys:
            raise ValueError("an App keeps at least one key")
        app.public_key, app.more_keys = keys[0], keys[1:]

    def add_org(self, login: str) -> Org:
        """An org with a default runner group ("Default", id 1 for the first org)."""
        if login in self.orgs:
            return self.orgs[login]
        org = Org(login, self.next_id())
        self.orgs[login] = org
        group_id = 1 if not any(g.default for g in self.runner_groups.values()) else None
        self.add_runner_group(login, "Default", default=True, group_id=group_id)
        return org

    def add_repo(self, full_name: str, private: bool = True) -> Repo:
        owner, name = full_name.split("/")
        if owner not in self.orgs:
            self.add_org(owner)
        repo = Repo(self.next_id(), owner, name, private)
        self.repos[full_name] = repo
        return repo

    def add_runner_group(
        self, org: str, name: str, default: bool = False, group_id: int | None = None
    ) -> RunnerGroup:
        if org not in self.orgs:
            self.add_org(org)
        group = RunnerGroup(group_id or self.next_id(), org, name, default)
        self.runner_groups[group.id] = group
        return group

    def add_installation(
        self, installation_id: int, app_id: int, account: str, permissions: Mapping[str, str]
    ) -> Installation:
        if account not in self.orgs:
            self.add_org(account)
        inst = Installation(installation_id, app_id, account, dict(permissions))
        inst.permissions.setdefault("metadata", "read")
        self.installations[installation_id] = inst
        return inst

    def add_pat(self, token: str, account: str) -> None:
        """A personal access token with full access to ``account``'s resources."""
        perms = {"administration": "write", "organization_self_hosted_runners": "write"}
        perms |= {"actions": "write", "metadata": "read"}
        self.pats[token] = TokenRec(token, None, account, perms, float("inf"))

    def seed(self, doc: Mapping[str, Any]) -> None:
        """Seed from a document: ``{"apps": [{"id", "public_key_pem"}], "orgs": [login],
        "repos": [full_name], "runner_groups": [{"org", "name", "default"?}],
        "installations": [{"id", "app_id", "account", "permissions"}],
        "pats": [{"token", "account"}], "token_ttl": seconds}``."""
        for app in doc.get("apps", []):
            self.add_app(int(app["id"]), app["public_key_pem"], app.get("slug", "impvm-test"))
        for login in doc.get("orgs", []):
            self.add_org(login)
        for full_name in doc.get("repos", []):
            self.add_repo(full_name)
        for group in doc.get("runner_groups", []):
            self.add_runner_group(group["org"], group["name"], bool(group.get("default", False)))
        for inst in doc.get("installations", []):
            self.add_installation(
                int(inst["id"]), int(inst["app_id"]), inst["account"], inst["permissions"]
            )
        for pat in doc.get("pats", []):
            self.add_pat(pat["token"], pat["account"])
        if "token_ttl" in doc:
            self.token_ttl = float(doc["token_ttl"])

    # ------------------------------------------------------------------ jobs

    def queue_job(
        self,
        repo: str,
        labels: Iterable[str],
        *,
        name: str = "build",
        workflow_name: str = "CI",
        command: list[str] | None = None,
        sleep_seconds: float = 0.0,
    ) -> JobRec:
        """Create a workflow run with one queued job needing ``labels``."""
        if repo not in self.repos:
            self.add_repo(repo)
        now = time.time()
        run = RunRec(
            id=self.next_id(),
            repo=repo,
            name=workflow_name,
            workflow_id=7,
            run_number=len(self.runs) + 1,
            created_at=now,
            updated_at=now,
        )
        self.runs[run.id] = run
        job = JobRec(
            id=self.next_id(),
            run_id=run.id,
            repo=repo,
            name=name,
            labels=list(labels),
            created_at=now,
            workflow_name=workflow_name,
            command=command,
            sleep_seconds=sleep_seconds,
        )
        self.jobs[job.id] = job
        return job

    def runner_can_take(self, runner: RunnerRec, job: JobRec) -> bool:
        """Label match (case-insensitive; ``self-hosted`` is implied for every self-hosted
        runner) and scope (org runner: any repo of the org; repo runner: that repo)."""
        have = {label.lower() for label in runner.labels} | {"self-hosted"}
        if not {label.lower() for label in job.labels} <= have:
            return False
        if runner.repo is not None:
            return runner.repo == job.repo
        return job.repo.split("/")[0] == runner.org

    def sync_run(self, run_id: int) -> None:
        run = self.runs[run_id]
        jobs = [j for j in self.jobs.values() if j.run_id == run_id]
        run.updated_at = time.time()
        if jobs and all(j.status == "completed" for j in jobs):
            run.status = "completed"
            failed = any(j.conclusion not in ("success", "skipped") for j in jobs)
            run.conclusion = "failure" if failed else "success"
        elif any(j.status == "in_progress" for j in jobs):
            run.status = "in_progress"

    # ------------------------------------------------------------------ shapes

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

    def new_secret(self, prefix: str) -> str:
        return prefix + secrets.token_urlsafe(27).replace("-", "a").replace("_", "b")[:36]
