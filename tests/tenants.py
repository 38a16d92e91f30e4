"""Two tenants on one cluster, for the tests that attack the boundaries between them: each a
namespace with its own GitHub App (its key, installation and organisation in one GitHub
stand-in), credentials Secret, webhook Secret, class, template and pool; pool passes and the
webhook receiver of one operator context, over real HTTP and a real API server.

Namespaces are named so that the attacker's sorts first (``a-...``) and the victim's last
(``z-...``): a rule that broke ties by name would favour the attacker."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from lightkube import AsyncClient, Client
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import AGENT_LEASE_NAMESPACE, WEBHOOK_SECRET_KEY
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import (
    INSTALLATION_PERMISSIONS,
    RUNNER_GROUP,
    app_secret,
    make_private_key,
    pool_manifest,
    random_webhook_secret,
)
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.records import JobRec
from impvm.github.webhooks import compute_signature
from impvm.kube.admin import service_account_kubeconfig
from impvm.kube.controlplane import free_port
from impvm.operator.context import OperatorContext
from impvm.operator.pool import PoolReconciler
from impvm.scaling.jobtable import JobTable

BASE_IMAGE = "registry.example/imp/runner-base@sha256:" + "1" * 64
RUNNER_LAYER = "registry.example/imp/runner-layer@sha256:" + "2" * 64
CREDENTIALS = "github-app"
WEBHOOK = "github-webhook"
TEMPLATE = "runner"
POOL = "ci"


@dataclass
class Tenant:
    """One team: its namespace, its App (id, installation, organisation, key), its webhook
    secret, and its class, template and pool once :meth:`create` made them."""

    ns: str
    org: str
    app_id: int
    installation_id: int
    key: str = field(repr=False)
    webhook_secret: str = field(repr=False)
    class_name: str = ""
    labels: tuple[str, ...] = ("imp",)

    @property
    def repo(self) -> str:
        return f"{self.org}/app"

    async def create(
        self,
        kube: AsyncClient,
        *,
        app_id: int | None = None,
        installation_id: int | None = None,
        key: str | None = None,
        scope_org: str | None = None,
        mode: str = "hybrid",
        min_idle: int = 0,
        class_spec: dict[str, Any] | None = None,
    ) -> None:
        """Namespace, class, template, credentials and webhook Secrets and the pool. The
        credentials name ``app_id``/``installation_id``/``key`` (default: the tenant's own)
        and the pool registers in ``scope_org`` (default: its own organisation)."""
        await kube.create(Namespace(metadata=ObjectMeta(name=self.ns)))
        self.class_name = self.class_name or f"cls-{self.ns}"
        await kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMClass",
                    "metadata": {"name": self.class_name},
                    "spec": class_spec or {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1},
                }
            )
        )
        await kube.create(
            ImpVMTemplateResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMTemplate",
                    "metadata": {"name": TEMPLATE, "namespace": self.ns},
                    "spec": {
                        "classRef": {"name": self.class_name},
                        "image": BASE_IMAGE,
                        "runnerLayer": RUNNER_LAYER,
                    },
                }
            )
        )
        await kube.create(
            app_secret(
                CREDENTIALS,
                self.ns,
                app_id or self.app_id,
                installation_id or self.installation_id,
                key or self.key,
            )
        )
        hook = base64.b64encode(self.webhook_secret.encode()).decode()
        await kube.create(
            Secret(
                metadata=ObjectMeta(name=WEBHOOK, namespace=self.ns),
                data={WEBHOOK_SECRET_KEY: hook},
            )
        )
        scaling: dict[str, Any] = {
            "mode": mode,
            "minIdle": min_idle,
            "maxConcurrent": 5,
            "scaleUpStep": 5,
            "cooldownSeconds": 0,
        }
        if mode in ("polling", "hybrid"):
            scaling["polling"] = {"enabled": True, "intervalSeconds": 30}
        if mode in ("webhook", "hybrid"):
            scaling["webhook"] = {"secretRef": {"name": WEBHOOK}}
        body = pool_manifest(
            POOL,
            self.ns,
            scaling,
            labels=list(self.labels),
            template=TEMPLATE,
            org=scope_org or self.org,
            credentials_secret=CREDENTIALS,
        )
        await kube.create(ImpVMRunnerPoolResource.from_dict(body))

    async def delete(self, kube: AsyncClient) -> None:
        for kind, name, ns in (
            (ImpVMClassResource, self.class_name, None),
            (Namespace, self.ns, None),
        ):
            try:
                await kube.delete(kind, name, namespace=ns)
            except Exception:
                pass

    # ---------------------------------------------------------------- observing

    async def pool(self, kube: AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = (
            await kube.get(ImpVMRunnerPoolResource, POOL, namespace=self.ns)
        ).to_dict()
        return out

    async def conditions(self, kube: AsyncClient) -> dict[str, dict[str, Any]]:
        status = (await self.pool(kube)).get("status") or {}
        return {c["type"]: c for c in status.get("conditions") or []}

    async def vms(self, kube: AsyncClient) -> list[dict[str, Any]]:
        return [o.to_dict() async for o in kube.list(ImpVMResource, namespace=self.ns)]

    async def jit_secrets(self, kube: AsyncClient) -> list[str]:
        return [
            s.metadata.name
            async for s in kube.list(Secret, namespace=self.ns)
            if s.metadata and s.metadata.name and s.metadata.name.endswith("-jit")
        ]

    def table(self, ctx: OperatorContext) -> JobTable | None:
        """The job table the tenant's pool is routed from (None: none). (An operator with one
        table for everything answers that one.)"""
        if not hasattr(ctx, "jobs_of"):
            return ctx.jobs  # type: ignore[return-value]
        return ctx.jobs_of((self.ns, POOL))

    def pending(self, ctx: OperatorContext) -> int:
        """Queued jobs routed to the tenant's pool."""
        table = self.table(ctx)
        scope = ctx.pool((self.ns, POOL)).scope
        if table is None or scope is None:
            return 0
        return table.pending(scope.key, ctx.scopes())

    async def run_pass(self, ctx: OperatorContext) -> float | None:
        return await PoolReconciler(ctx).reconcile((self.ns, POOL))


def tenant(prefix: str, app_id: int, installation_id: int, org: str) -> Tenant:
    """A tenant with a fresh namespace name, key and webhook secret."""
    return Tenant(
        ns=f"{prefix}-{uuid.uuid4().hex[:8]}",
        org=org,
        app_id=app_id,
        installation_id=installation_id,
        key=make_private_key(),
        webhook_secret=random_webhook_secret(),
    )


def seed_app(standin: StandIn, t: Tenant) -> None:
    """Give the stand-in the tenant's App (its key), organisation, repository, runner group and
    the App's installation there."""
    st = standin.state
    st.add_app(t.app_id, t.key, slug=f"app-{t.app_id}")
    st.add_org(t.org)
    st.add_repo(t.repo)
    st.add_runner_group(t.org, RUNNER_GROUP)
    st.add_installation(t.installation_id, t.app_id, t.org, INSTALLATION_PERMISSIONS)


def signed(
    standin: StandIn,
    secret: str,
    action: str,
    job: JobRec,
    installation_id: int | None,
    **job_fields: Any,
) -> tuple[bytes, dict[str, str]]:
    """A ``workflow_job`` delivery about ``job`` (the stand-in's shapes, ``job_fields`` set in
    its ``workflow_job``), signed with ``secret``: what anyone holding that secret can send."""
    payload = standin.state.workflow_job_payload(action, job, installation_id)
    payload["workflow_job"].update(job_fields)
    body = json.dumps(payload).encode()
    headers = {
        "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": compute_signature(secret, body),
        "Content-Type": "application/json",
    }
    return body, headers


async def deliver(url: str, deliveries: Iterable[tuple[bytes, dict[str, str]]]) -> list[int]:
    """POST each delivery to the receiver; their HTTP statuses."""
    async with httpx.AsyncClient(timeout=30) as http:
        return [
            (await http.post(url, content=body, headers=headers)).status_code
            for body, headers in deliveries
        ]


# --------------------------------------------------------------------------------------------
# A real operator process


REPO_ROOT = Path(__file__).resolve().parent.parent
OPERATOR_RBAC = REPO_ROOT / "deploy" / "rbac" / "operator.yaml"


def operator_kubeconfig(kube: Client, admin_kubeconfig: Path, out: Path) -> Path:
    """Apply deploy/rbac/operator.yaml (as ``kubectl apply`` would: existing objects are left)
    and write a kubeconfig acting as its ServiceAccount to ``out``."""
    for obj in load_all_yaml(OPERATOR_RBAC.read_text()):
        try:
            kube.create(obj)
        except ApiError as e:
            if e.status.code != 409:
                raise
    config = service_account_kubeconfig(
        kube, admin_kubeconfig, AGENT_LEASE_NAMESPACE, "impvm-operator", create=False
    )
    out.write_text(yaml.safe_dump(config))
    out.chmod(0o600)
    return out


@dataclass
class OperatorProcess:
    """``impvm operator`` as a process of its own (its log in ``log``), on ``port``."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (it gives up its Lease), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_operator(
    kubeconfig: Path,
    workdir: Path,
    github_url: str,
    namespaces: Iterable[str],
    *extra: str,
) -> OperatorProcess:
    """Start ``impvm operator`` watching ``namespaces`` (the leader Lease first deleted, so no
    holder left by an earlier test delays it)."""
    kube = Client(config=KubeConfig.from_file(str(kubeconfig)))
    try:
        kube.create(Namespace(metadata=ObjectMeta(name=AGENT_LEASE_NAMESPACE)))
    except ApiError as e:
        if e.status.code not in (403, 409):
            raise
    try:
        kube.delete(Lease, "impvm-operator", namespace=AGENT_LEASE_NAMESPACE)
    except ApiError as e:
        if e.status.code not in (403, 404):
            raise
    port = free_port()
    log = workdir / f"operator-{port}.log"
    args = [
        str(Path(sys.executable).with_name("impvm")),
        "operator",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--github-api-url",
        github_url,
        "--advertise-url",
        f"http://127.0.0.1:{port}",
        *extra,
    ]
    for ns in namespaces:
        args += ["--namespace", ns]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    return OperatorProcess(proc, port, log)


async def leading(op: OperatorProcess, seconds: float = 120) -> None:
    """Wait until ``op`` answers ``/healthz`` as the leader (raising if it died)."""
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            if not op.alive():
                raise RuntimeError(f"operator exited: {op.log.read_text()[-3000:]}")
            try:
                r = await http.get(f"{op.url}/healthz")
                if r.status_code == 200 and "leader" in r.text:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the operator did not lead")
            await asyncio.sleep(0.2)
