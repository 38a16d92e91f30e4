"""State of the GitHub stand-in: :class:`StandInState`, which holds the records of
:mod:`impvm.devstack.standin.records`, seeds them and queues and settles jobs.

The GitHub-shaped JSON it renders (runners, runner groups, workflow runs, jobs, repositories,
users, ``workflow_job`` webhook payloads, shaped like ``@octokit/webhooks-examples``) it inherits
from :mod:`impvm.devstack.standin.shapes` and :mod:`impvm.devstack.standin.run_shapes`; shapes
follow GitHub's REST OpenAPI description (checked in tests with githubkit's models).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from impvm.devstack.standin.records import (
    App,
    Delivery,
    Failure,
    Installation,
    JobRec,
    Org,
    RateBucket,
    Repo,
    RunnerGroup,
    RunnerRec,
    RunRec,
    TokenRec,
    WebhookTarget,
)
from impvm.devstack.standin.run_shapes import RunShapes


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


@dataclass
class StandInState(RunShapes):
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

    def new_secret(self, prefix: str) -> str:
        return prefix + secrets.token_urlsafe(27).replace("-", "a").replace("_", "b")[:36]
