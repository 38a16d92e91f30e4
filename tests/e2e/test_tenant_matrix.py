"""The tenant matrix: two teams on one cluster, each trying every cross-tenant action on the
other, and every one refused.

The cluster is the real API server with the chart's RBAC (deploy/rbac: the operator acting as
its ServiceAccount; each team a real user, alice and bob, with the built-in ``edit`` role, impvm's
tenant role aggregated in, in its own namespace only) and the admission policy of deploy/admission.
One real ``impvm operator`` process serves both, cluster-wide. The GitHub stand-in hosts two
Apps, each installed on its team's organisation, each with its own key and its own webhook
secret, delivering to the operator.

Each test is one cross-tenant action, tried in both directions where it can be (the team whose
namespace sorts first, ``a-...``, is the attacker in the one-way ones: a rule that broke ties by
name would favour it):

1. naming the other team's App ID and installation ID with a key of one's own;
2. a ``completed`` delivery, signed with one's own secret, for the other team's queued job;
3. an ``in_progress`` delivery naming the other team's runner;
4. a namespace flooded with more Secrets than any cache bound;
5. using a class restricted to the other namespace;
6. referencing the other team's Secrets by name from one's own pool and template;
7. reading or changing the other team's Secrets, VMs and pools through the API;
8. asking the operator's JIT hand-out for the other team's JIT config.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lightkube import ApiError, AsyncClient, Client
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import RoleRef, Subject
from lightkube.resources.core_v1 import Secret, ServiceAccount, ServiceAccountToken
from lightkube.resources.rbac_authorization_v1 import RoleBinding
from lightkube.types import PatchType

from impvm.api.models import JIT_HANDOUT_AUDIENCE
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.standin import StandIn
from impvm.kube.controlplane import ControlPlane
from tests.tenants import (
    BASE_IMAGE,
    CREDENTIALS,
    POOL,
    TEMPLATE,
    OperatorProcess,
    Tenant,
    deliver,
    leading,
    operator_kubeconfig,
    seed_app,
    signed,
    start_operator,
    tenant,
)

pytestmark = [pytest.mark.controlplane]

REPO = Path(__file__).resolve().parents[2]
FLOOD = 5_100  # more Secrets than the operator's old cache of every Secret held (5,000)


@dataclass
class Team:
    """A tenant and the user who acts for it (only in its own namespace)."""

    t: Tenant
    user: str
    kube: Client  # as that user

    @property
    def ns(self) -> str:
        return self.t.ns


@dataclass
class Matrix:
    admin: AsyncClient
    sync_admin: Client
    standin: StandIn
    operator: OperatorProcess
    a: Team  # sorts first
    b: Team

    def pair(self, attacker: str) -> tuple[Team, Team]:
        """(attacker, victim)."""
        return (self.a, self.b) if attacker == "a" else (self.b, self.a)

    @property
    def webhook(self) -> str:
        return f"{self.operator.url}/webhooks/github"


async def until(what: str, check: Callable[[], Any], seconds: float = 120) -> Any:
    """Poll ``check()`` (sync or async) until truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.5)


def tenant_roles(kube: Client) -> None:
    """deploy/rbac/tenant.yaml (kubectl apply semantics)."""
    for obj in load_all_yaml((REPO / "deploy" / "rbac" / "tenant.yaml").read_text()):
        try:
            kube.create(obj)
        except ApiError as e:
            if e.status.code != 409:
                raise


def admission(kube: Client) -> None:
    for path in sorted((REPO / "deploy" / "admission").glob("*.yaml")):
        for obj in load_all_yaml(path.read_text()):
            try:
                kube.create(obj)
            except ApiError as e:
                if e.status.code != 409:
                    raise


def bind(kube: Client, ns: str, user: str) -> None:
    """``user`` gets the built-in edit role in ``ns`` only: the roles aggregated into it, bound
    one by one (the test control plane runs no clusterrole-aggregation controller), impvm's
    tenant role among them."""
    for role in ("system:aggregate-to-view", "system:aggregate-to-edit", "impvm-edit"):
        kube.create(
            RoleBinding(
                metadata=ObjectMeta(name=f"{user}-{role.replace(':', '-')}", namespace=ns),
                roleRef=RoleRef(
                    apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name=role
                ),
                subjects=[Subject(kind="User", name=user, apiGroup="rbac.authorization.k8s.io")],
            )
        )


@pytest.fixture(scope="module")
async def matrix(
    control_plane: ControlPlane, kube: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Matrix]:
    work = tmp_path_factory.mktemp("matrix")
    admin = AsyncClient(config=KubeConfig.from_file(str(control_plane.kubeconfig)))
    standin = StandIn()
    await standin.start()
    ta = tenant("a-team", 35001, 45001, "a-org")
    tb = tenant("z-team", 35002, 45002, "z-org")
    for t in (ta, tb):
        seed_app(standin, t)
    tenant_roles(kube)
    admission(kube)
    teams = []
    for t, user in ((ta, "alice"), (tb, "bob")):
        await t.create(admin, mode="hybrid", min_idle=1)
        bind(kube, t.ns, user)
        path = control_plane.client_kubeconfig(work / f"{user}.kubeconfig", user, [])
        teams.append(Team(t, user, Client(config=KubeConfig.from_file(str(path)))))
    config = operator_kubeconfig(kube, control_plane.kubeconfig, work / "operator.kubeconfig")
    op = start_operator(config, work, standin.url, [])  # cluster-wide, as the chart's default
    try:
        await leading(op)
        for t in (ta, tb):
            standin.add_webhook(f"{op.url}/webhooks/github", t.webhook_secret, app_id=t.app_id)
        m = Matrix(admin, kube, standin, op, teams[0], teams[1])
        for team in (m.a, m.b):
            await until(f"{team.ns}'s idle VM with its JIT config", lambda t=team: jit_vm(m, t))
        yield m
    finally:
        op.stop()
        for t in (ta, tb):
            await t.delete(admin)
        await standin.stop()
        await admin.close()


async def jit_vm(m: Matrix, team: Team) -> dict[str, Any] | None:
    """A VM of the team's pool that has its JIT Secret."""
    for vm in await team.t.vms(m.admin):
        if vm["spec"].get("runnerConfigSecret"):
            return vm
    return None


async def pool_status(m: Matrix, team: Team) -> dict[str, Any]:
    status: dict[str, Any] = (await team.t.pool(m.admin)).get("status") or {}
    return status


def refused(call: Callable[[], Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status.code in (403, 404, 422), e.value.status
    return e.value


# ------------------------------------------------------------------------------- 1. credentials


async def test_naming_the_others_app_and_installation_with_an_own_key_mints_nothing(
    matrix: Matrix,
) -> None:
    m = matrix
    attacker, victim = m.pair("a")
    own_key = attacker.t.key  # the attacker's App key, not the victim's
    data = {
        "github_app_id": str(victim.t.app_id),
        "github_app_installation_id": str(victim.t.installation_id),
        "github_app_private_key": own_key,
    }
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    attacker.kube.create(
        Secret(metadata=ObjectMeta(name="borrowed", namespace=attacker.ns), data=encoded)
    )
    body = {
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVMRunnerPool",
        "metadata": {"name": "borrow", "namespace": attacker.ns},
        "spec": {
            "templateName": TEMPLATE,
            "labels": ["imp"],
            "platform": {
                "type": "github-actions",
                "scope": {"org": victim.t.org},
                "credentialsSecret": "borrowed",
                "tokenSource": "github_app",
            },
            "scaling": {
                "mode": "polling",
                "minIdle": 1,
                "maxConcurrent": 2,
                "scaleUpStep": 1,
                "cooldownSeconds": 0,
                "polling": {"enabled": True, "intervalSeconds": 10},
            },
        },
    }
    attacker.kube.create(ImpVMRunnerPoolResource.from_dict(body))

    async def refused_by_github() -> bool:
        pool = await m.admin.get(ImpVMRunnerPoolResource, "borrow", namespace=attacker.ns)
        conds = {c["type"]: c for c in (pool.to_dict().get("status") or {}).get("conditions", [])}
        c = conds.get("CredentialsInvalid")
        return c is not None and c["status"] == "True" and c["reason"] == "BadCredentials"

    await until("the borrowing pool refused by GitHub", refused_by_github)
    # nothing registered in the victim's organisation under the attacker's pool
    pool = (await m.admin.get(ImpVMRunnerPoolResource, "borrow", namespace=attacker.ns)).to_dict()
    prefix = f"borrow-{pool['metadata']['uid'][:5]}-"
    assert not [r for r in m.standin.state.runners.values() if r.name.startswith(prefix)]
    vms = [
        v
        async for v in m.admin.list(ImpVMResource, namespace=attacker.ns)
        if v.metadata and v.metadata.name and v.metadata.name.startswith(prefix)
    ]
    assert all(not (v.spec or {}).get("runnerConfigSecret") for v in vms)  # type: ignore[union-attr]
    # and the victim's own pool goes on
    victim_conds = {c["type"]: c for c in (await pool_status(m, victim)).get("conditions", [])}
    assert victim_conds["CredentialsInvalid"]["status"] == "False"
    attacker.kube.delete(ImpVMRunnerPoolResource, "borrow", namespace=attacker.ns)


# ------------------------------------------------------------------------------- 2, 3. deliveries


@pytest.mark.parametrize("attacker_side", ["a", "b"])
async def test_a_completed_delivery_signed_with_an_own_secret_leaves_the_others_job(
    matrix: Matrix, attacker_side: str
) -> None:
    m = matrix
    attacker, victim = m.pair(attacker_side)
    before = (await pool_status(m, victim)).get("pendingJobs", 0)
    job = m.standin.queue_job(victim.t.repo, ["self-hosted", "imp"])  # the victim's App tells

    async def pending() -> int:
        return int((await pool_status(m, victim)).get("pendingJobs", 0))

    await until("the victim's job pending", lambda: _more(pending, before))
    forged = [
        signed(m.standin, attacker.t.webhook_secret, "completed", job, inst)
        for inst in (victim.t.installation_id, attacker.t.installation_id, None)
    ]
    assert set(await deliver(m.webhook, forged)) <= {200, 202}
    # over the victim's next passes (every 10 s at rest) the job stays its demand
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline:
        assert await pending() > before, "a forged delivery took the victim's job away"
        await asyncio.sleep(1)
    assert job.status == "queued"


async def _more(read: Callable[[], Any], than: int) -> bool:
    return bool(await read() > than)


@pytest.mark.parametrize("attacker_side", ["a", "b"])
async def test_an_in_progress_delivery_naming_the_others_runner_attaches_nothing(
    matrix: Matrix, attacker_side: str
) -> None:
    m = matrix
    attacker, victim = m.pair(attacker_side)
    vm = await until("the victim's VM", lambda: jit_vm(m, victim))
    runner = vm["metadata"]["name"]
    job = m.standin.state.queue_job(attacker.t.repo, ["self-hosted", "imp"])
    started = signed(
        m.standin,
        attacker.t.webhook_secret,
        "in_progress",
        job,
        attacker.t.installation_id,
        status="in_progress",
        runner_name=runner,
        started_at="2026-01-01T00:00:00Z",
    )
    assert await deliver(m.webhook, [started]) == [202]
    # the victim's pool passes (woken every few seconds) never record the foreign run
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        got = (await m.admin.get(ImpVMResource, runner, namespace=victim.ns)).to_dict()
        assert "job" not in (got.get("status") or {}), got["status"]
        await asyncio.sleep(1)


# ------------------------------------------------------------------------------- 4. Secrets flood


async def test_a_namespace_flooded_with_secrets_pushes_out_no_others_credentials(
    matrix: Matrix,
) -> None:
    """The attacker (its namespace sorts first) creates more Secrets than any cache bound in
    its own namespace; then the victim adds a pool with new credentials. The victim's pool
    finds them, and the operator's memory holds none of the flood."""
    m = matrix
    attacker, victim = m.pair("a")
    marker = f"flood-{uuid.uuid4().hex}"
    slots = asyncio.Semaphore(16)
    client = AsyncClient(config=attacker.kube.config)  # the attacker's own identity

    async def one(i: int) -> None:
        value = base64.b64encode(f"{marker}-{i:05d}".encode()).decode()
        secret = Secret(metadata=ObjectMeta(name=f"f-{i:05d}", namespace=attacker.ns))
        secret.data = {"v": value}
        async with slots:
            await client.create(secret)

    try:
        await asyncio.gather(*(one(i) for i in range(FLOOD)))
    finally:
        await client.close()
    creds = victim.kube.get(Secret, CREDENTIALS, namespace=victim.ns)
    victim.kube.create(
        Secret(metadata=ObjectMeta(name="second-app", namespace=victim.ns), data=creds.data)
    )
    pool = victim.t.pool  # the victim's pool, copied under another name and Secret
    body = await pool(m.admin)
    spec = body["spec"]
    spec["platform"]["credentialsSecret"] = "second-app"
    spec["labels"] = ["second"]
    victim.kube.create(
        ImpVMRunnerPoolResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMRunnerPool",
                "metadata": {"name": "second", "namespace": victim.ns},
                "spec": spec,
            }
        )
    )

    async def second_vm() -> bool:
        return any(
            v["metadata"]["name"].startswith("second-") and v["spec"].get("runnerConfigSecret")
            for v in await victim.t.vms(m.admin)
        )

    await until("the victim's new pool's VM with its JIT config", second_vm)
    from tests.operator.test_named_secrets import memory_holds

    needles = [f"{marker}-{i:05d}".encode() for i in (0, FLOOD // 2, FLOOD - 1)]
    assert memory_holds(m.operator.proc.pid, needles + [base64.b64encode(n) for n in needles]) == []
    victim.kube.delete(ImpVMRunnerPoolResource, "second", namespace=victim.ns)


# ------------------------------------------------------------------------------- 5. classes


@pytest.mark.parametrize("attacker_side", ["a", "b"])
def test_a_class_restricted_to_the_other_namespace_is_refused(
    matrix: Matrix, attacker_side: str
) -> None:
    m = matrix
    attacker, victim = m.pair(attacker_side)
    name = f"only-{victim.ns}"
    rule = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [victim.ns]}
    try:
        m.sync_admin.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMClass",
                    "metadata": {"name": name},
                    "spec": {
                        "vcpu": 1,
                        "memoryMiB": 512,
                        "diskGiB": 1,
                        "network": {
                            "egress": {"policy": "allowlist", "allow": [{"cidr": "10.0.0.0/8"}]}
                        },
                        "namespaces": {
                            "from": "Selector",
                            "selector": {"matchExpressions": [rule]},
                        },
                    },
                }
            )
        )
    except ApiError as e:
        if e.status.code != 409:
            raise

    def make(team: Team, tname: str) -> None:
        team.kube.create(
            ImpVMTemplateResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMTemplate",
                    "metadata": {"name": tname, "namespace": team.ns},
                    "spec": {"classRef": {"name": name}, "image": BASE_IMAGE},
                }
            ),
            dry_run=True,
        )

    deadline = time.monotonic() + 30
    while True:  # the policy reads classes from a watch: wait until it knows this one
        try:
            make(attacker, "probe")
        except ApiError:
            break
        assert time.monotonic() < deadline, (
            "a template of a class for another namespace was accepted"
        )
        time.sleep(0.2)
    e = refused(lambda: make(attacker, "internal"))
    assert name in str(e.status.message) and attacker.ns in str(e.status.message)
    make(victim, "internal")  # the namespace it selects may
    # the attacker's own pool cannot be pointed at it either: its template is refused, and a VM
    # the attacker made by hand would be refused by RBAC before admission
    refused(
        lambda: attacker.kube.patch(
            ImpVMTemplateResource,
            TEMPLATE,
            {"spec": {"classRef": {"name": name}}},
            namespace=attacker.ns,
            patch_type=PatchType.MERGE,
        )
    )
    refused(
        lambda: attacker.kube.create(
            ImpVMResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVM",
                    "metadata": {"name": "by-hand", "namespace": attacker.ns},
                    "spec": {"classRef": {"name": name}, "image": BASE_IMAGE},
                }
            )
        )
    )


# ------------------------------------------------------------------------------- 6. Secret refs


@pytest.mark.parametrize("attacker_side", ["a", "b"])
async def test_naming_the_others_secrets_from_an_own_pool_reads_nothing_of_theirs(
    matrix: Matrix, attacker_side: str
) -> None:
    m = matrix
    attacker, victim = m.pair(attacker_side)
    secret = f"only-in-{victim.ns}"
    victim.kube.create(
        Secret(
            metadata=ObjectMeta(name=secret, namespace=victim.ns),
            data={"github_token": base64.b64encode(b"ghp_victims").decode()},
        )
    )
    body = {
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVMRunnerPool",
        "metadata": {"name": "refs", "namespace": attacker.ns},
        "spec": {
            "templateName": TEMPLATE,
            "labels": ["refs"],
            "platform": {
                "type": "github-actions",
                "scope": {"org": attacker.t.org},
                "credentialsSecret": secret,
                "tokenSource": "pat",
            },
            "scaling": {
                "mode": "webhook",
                "minIdle": 0,
                "maxConcurrent": 1,
                "scaleUpStep": 1,
                "cooldownSeconds": 0,
                "webhook": {"secretRef": {"name": secret}},
            },
        },
    }
    attacker.kube.create(ImpVMRunnerPoolResource.from_dict(body))

    async def says_missing() -> dict[str, Any] | None:
        pool = (await m.admin.get(ImpVMRunnerPoolResource, "refs", namespace=attacker.ns)).to_dict()
        conds = {c["type"]: c for c in (pool.get("status") or {}).get("conditions", [])}
        c = conds.get("CredentialsInvalid")
        return c if c is not None and c["status"] == "True" else None

    cond = await until("the pool naming another namespace's Secret", says_missing)
    assert cond["reason"] == "CredentialsError" and "not found" in cond["message"], cond
    assert "ghp_victims" not in m.operator.log.read_text()
    attacker.kube.delete(ImpVMRunnerPoolResource, "refs", namespace=attacker.ns)
    victim.kube.delete(Secret, secret, namespace=victim.ns)


# ------------------------------------------------------------------------------- 7. RBAC


@pytest.mark.parametrize("attacker_side", ["a", "b"])
async def test_the_others_secrets_vms_and_pools_cannot_be_read_or_changed(
    matrix: Matrix, attacker_side: str
) -> None:
    m = matrix
    attacker, victim = m.pair(attacker_side)
    vm = await until("the victim's VM", lambda: jit_vm(m, victim))
    k, ns = attacker.kube, victim.ns
    refused(lambda: k.get(Secret, CREDENTIALS, namespace=ns))
    refused(lambda: k.get(Secret, vm["spec"]["runnerConfigSecret"], namespace=ns))
    refused(lambda: list(k.list(Secret, namespace=ns)))
    refused(lambda: list(k.list(Secret, namespace="*")))
    refused(lambda: k.get(ImpVMResource, vm["metadata"]["name"], namespace=ns))
    refused(lambda: list(k.list(ImpVMResource, namespace=ns)))
    refused(lambda: k.get(ImpVMRunnerPoolResource, POOL, namespace=ns))
    refused(lambda: k.get(ImpVMTemplateResource, TEMPLATE, namespace=ns))
    refused(
        lambda: k.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {"spec": {"scaling": {"maxConcurrent": 0}}},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )
    )
    refused(lambda: k.delete(ImpVMResource, vm["metadata"]["name"], namespace=ns))
    refused(
        lambda: k.create(
            Secret(metadata=ObjectMeta(name="planted", namespace=ns), data={"x": "eA=="})
        )
    )
    # and in its own namespace it may do its work, but never make or change a VM itself
    own = await until("the attacker's own VM", lambda: jit_vm(m, attacker))
    k.get(ImpVMRunnerPoolResource, POOL, namespace=attacker.ns)
    refused(
        lambda: k.patch(
            ImpVMResource,
            own["metadata"]["name"],
            {"spec": {"image": BASE_IMAGE}},
            namespace=attacker.ns,
            patch_type=PatchType.MERGE,
        )
    )


# ------------------------------------------------------------------------------- 8. hand-out


@pytest.mark.parametrize("attacker_side", ["a", "b"])
async def test_the_jit_handout_gives_a_team_nothing(matrix: Matrix, attacker_side: str) -> None:
    """A ServiceAccount the attacker makes in its own namespace, with a token for the
    hand-out's audience, asks for the victim's JIT config (and for its own): refused."""
    m = matrix
    attacker, victim = m.pair(attacker_side)
    sa = f"fake-agent-{uuid.uuid4().hex[:6]}"
    attacker.kube.create(ServiceAccount(metadata=ObjectMeta(name=sa, namespace=attacker.ns)))
    req = ServiceAccountToken(
        metadata=ObjectMeta(name=sa, namespace=attacker.ns),
        spec=TokenRequestSpec(audiences=[JIT_HANDOUT_AUDIENCE], expirationSeconds=600),
    )
    out = m.sync_admin.create(req, name=sa, namespace=attacker.ns)  # however it got one
    assert out.status is not None
    token = out.status.token
    targets = [await jit_vm(m, victim), await jit_vm(m, attacker)]
    async with httpx.AsyncClient(timeout=30) as h:
        for vm, team in zip(targets, (victim, attacker), strict=True):
            assert vm is not None
            r = await h.get(
                f"{m.operator.url}/agents/v1/namespaces/{team.ns}/impvms/"
                f"{vm['metadata']['name']}/jitconfig",
                headers={"Authorization": f"Bearer {token}"},
            )
            assert r.status_code == 403 and "jitconfig" not in r.text, r.text
