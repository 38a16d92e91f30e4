"""Fixtures for the reaper pass tests: the real control plane (session),
a fresh namespace, the GitHub stand-in over real HTTP, and helpers that create a pool, its
credentials Secret and VMs whose status records jobs the stand-in knows."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from lightkube import Client
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType
from pydantic import SecretStr

from impvm.api.models import API_VERSION, POOL_LABEL
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.seed import app_secret, make_private_key, pool_manifest
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.records import JobRec, RunnerRec, RunRec
from impvm.github import AppCredentials, GitHubClient, RetryPolicy
from tests.support import standin_fixture

APP_ID = 5151
INSTALLATION_ID = 88
ORG = "octo-org"
REPO = "octo-org/app"
SECRET = "github-runner-app"
DIGEST = "sha256:" + "a" * 64
#: What the installation grants in most tests (everything the operator needs, no more).
GRANTED = {
    "organization_self_hosted_runners": "write",
    "administration": "write",
    "actions": "read",
    "metadata": "read",
}
TOKEN_PATH = "/app/installations/{installation_id}/access_tokens"
RUN_PATH = "/repos/{owner}/{repo}/actions/runs/{run_id}"
JOB_PATH = "/repos/{owner}/{repo}/actions/jobs/{job_id}"


@pytest.fixture(scope="session")
def private_key() -> str:
    return make_private_key(pkcs8=True)


standin = standin_fixture(APP_ID, INSTALLATION_ID, ORG, GRANTED, [REPO])


@pytest.fixture
async def github(standin: StandIn, private_key: str) -> AsyncIterator[GitHubClient]:
    """A client for the stand-in's App installation (what the operator would build)."""
    client = GitHubClient(
        AppCredentials(APP_ID, INSTALLATION_ID, SecretStr(private_key)),
        api_url=standin.url,
        timeout=5.0,
        retry=RetryPolicy(max_transient_retries=0),
    )
    yield client
    await client.close()


def now() -> datetime:
    return datetime.now(UTC)


def ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Seeded:
    """A run (and job) in the stand-in for one VM."""

    run_id: int
    job_id: int
    runner_id: int | None = None


@dataclass
class World:
    """One test's pool in ``namespace`` and its VMs (names by role)."""

    kube: Client
    namespace: str
    standin: StandIn
    private_key: str
    pool_name: str = "ci"
    pool: dict[str, Any] = field(default_factory=dict)
    vms: dict[str, str] = field(default_factory=dict)

    # -------------------------------------------------------------- Kubernetes side

    def create_secret(self, name: str = SECRET) -> None:
        self.kube.create(
            app_secret(name, self.namespace, APP_ID, INSTALLATION_ID, self.private_key)
        )

    def create_pool(self, name: str | None = None, **reaper: Any) -> dict[str, Any]:
        name = name or self.pool_name
        scaling = {
            "mode": "manual",
            "minIdle": 0,
            "maxConcurrent": 10,
            "scaleUpStep": 1,
            "cooldownSeconds": 0,
        }
        body = pool_manifest(
            name,
            self.namespace,
            scaling,
            org=ORG,
            runner_group=None,
            credentials_secret=SECRET,
            reaper={"enabled": True, "maxJobSeconds": 3600, **reaper},
        )
        pool = self.kube.create(ImpVMRunnerPoolResource.from_dict(body)).to_dict()
        if name == self.pool_name:
            self.pool = pool
        return dict(pool)

    def refresh_pool(self) -> dict[str, Any]:
        self.pool = self.kube.get(
            ImpVMRunnerPoolResource, self.pool_name, namespace=self.namespace
        ).to_dict()
        return self.pool

    def create_vm(
        self,
        role: str,
        seeded: Seeded | None = None,
        *,
        pool: dict[str, Any] | None = None,
        job: dict[str, Any] | None = None,
        started: datetime | None = None,
    ) -> str:
        """An ImpVM of ``pool`` (default: the world's pool), labelled and controlled by it,
        with ``status.job`` recording ``seeded``'s run/job (or ``job`` verbatim)."""
        owner = pool or self.pool
        meta = owner["metadata"]
        name = f"{meta['name']}-{role}-{uuid.uuid4().hex[:4]}"
        body = {
            "apiVersion": API_VERSION,
            "kind": "ImpVM",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {POOL_LABEL: meta["name"]},
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": "ImpVMRunnerPool",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "classRef": {"name": "runner-class"},
                "image": f"registry.example/imp/base@{DIGEST}",
                "lifecycle": "ephemeral",
            },
        }
        self.kube.create(ImpVMResource.from_dict(body))
        status: dict[str, Any] = {"phase": "Running", "startedAt": ts(now() - timedelta(hours=1))}
        runner_id = seeded.runner_id if seeded else None
        status["runner"] = {
            "id": runner_id if runner_id is not None else 1,
            "name": name,
            "online": True,
            "busy": seeded is not None,
        }
        if seeded is not None:
            status["job"] = {
                "id": seeded.job_id,
                "workflowRunId": seeded.run_id,
                "repository": REPO,
                "startedAt": ts(started or now()),
            }
        elif job is not None:
            status["job"] = job
        self.kube.patch(
            ImpVMResource.Status,
            name,
            {"status": status},
            namespace=self.namespace,
            patch_type=PatchType.MERGE,
        )
        if pool is None:
            self.vms[role] = name
        return name

    def vm_names(self) -> set[str]:
        return {
            o.to_dict()["metadata"]["name"]
            for o in self.kube.list(ImpVMResource, namespace=self.namespace)
        }

    def events(self, reason: str | None = None) -> list[Event]:
        return [
            e
            for e in self.kube.list(Event, namespace=self.namespace)
            if e.involvedObject.name == self.pool_name and (reason is None or e.reason == reason)
        ]

    def condition(self, type_: str = "Reaper") -> dict[str, Any] | None:
        conds = (self.refresh_pool().get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == type_), None)

    # -------------------------------------------------------------- GitHub side

    def seed(
        self,
        *,
        run_status: str,
        run_conclusion: str | None = None,
        run_updated_ago: float = 0.0,
        job_status: str,
        job_conclusion: str | None = None,
        job_started_ago: float = 0.0,
        job_completed_ago: float | None = None,
        runner: str | None = None,
        runner_busy: bool = False,
    ) -> Seeded:
        """A run with one job in the stand-in, times given as seconds before now; with
        ``runner``, a registered runner of that name that took the job."""
        st = self.standin.state
        t = time.time()
        run = RunRec(
            id=st.next_id(),
            repo=REPO,
            name="CI",
            workflow_id=7,
            run_number=len(st.runs) + 1,
            created_at=t - max(job_started_ago, run_updated_ago) - 5,
            updated_at=t - run_updated_ago,
            status=run_status,
            conclusion=run_conclusion,
        )
        st.runs[run.id] = run
        runner_id = None
        if runner is not None:
            rec = RunnerRec(
                id=st.next_id(),
                name=runner,
                labels=["imp"],
                group_id=1,
                org=ORG,
                repo=None,
                session_token=st.new_secret("sess_"),
                work_folder="_work",
                status="online" if runner_busy else "offline",
                busy=runner_busy,
            )
            st.runners[rec.id] = rec
            runner_id = rec.id
        job = JobRec(
            id=st.next_id(),
            run_id=run.id,
            repo=REPO,
            name="build",
            labels=["self-hosted", "imp"],
            created_at=t - job_started_ago - 5,
            workflow_name="CI",
            status=job_status,
            conclusion=job_conclusion,
            started_at=t - job_started_ago,
            completed_at=None if job_completed_ago is None else t - job_completed_ago,
            runner_id=runner_id,
            runner_name=runner,
        )
        st.jobs[job.id] = job
        return Seeded(run_id=run.id, job_id=job.id, runner_id=runner_id)

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.standin.state.requests if path is None or r["path"] == path]

    def secret_values(self) -> list[str]:
        """Every secret a pass could leak: installation tokens and the App's private key."""
        return [*self.standin.state.tokens, self.private_key]


@pytest.fixture
def world(kube: Client, namespace: str, standin: StandIn, private_key: str) -> World:
    w = World(kube=kube, namespace=namespace, standin=standin, private_key=private_key)
    w.create_secret()
    return w


def four_vms(world: World) -> None:
    """The reaper proposal's scenario: idle, hung (job started 10 days ago; bound 1 hour), cancelled run
    (completed 1 day ago), busy (job started 60 s ago). Each job VM's runner is registered."""
    day = 86400.0
    hung = world.seed(
        run_status="in_progress",
        job_status="in_progress",
        job_started_ago=10 * day,
        runner="hung-runner",
        runner_busy=True,
    )
    cancelled = world.seed(
        run_status="completed",
        run_conclusion="cancelled",
        run_updated_ago=day,
        job_status="completed",
        job_conclusion="cancelled",
        job_started_ago=day + 60,
        job_completed_ago=day,
        runner="cancelled-runner",
    )
    busy = world.seed(
        run_status="in_progress",
        job_status="in_progress",
        job_started_ago=60,
        runner="busy-runner",
        runner_busy=True,
    )
    world.create_vm("idle")
    world.create_vm("hung", hung, started=now() - timedelta(days=10))
    world.create_vm("cancelled", cancelled, started=now() - timedelta(days=1, seconds=60))
    world.create_vm("busy", busy, started=now() - timedelta(seconds=60))
