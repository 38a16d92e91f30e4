"""No node can read the App key: the agent's ServiceAccount (deploy/rbac/agent.yaml) reads no
Secret, proven by SubjectAccessReviews against the real API server, and the operator's JIT
config hand-out gives an agent only the JIT configs of VMs bound to its own node (tokens bound to
Node objects, a real aiohttp server on loopback, the operator acting as its ServiceAccount)."""

from __future__ import annotations

import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightkube import ApiError, AsyncClient, Client
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.core_v1 import Node, Secret, ServiceAccountToken
from lightkube.types import PatchType

from impvm.agent.jitsource import JitSourceError, OperatorJitSource
from impvm.api.models import AGENT_LEASE_NAMESPACE, API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMResource
from impvm.kube.admin import node_bound_token, service_account_kubeconfig
from impvm.kube.controlplane import ControlPlane, free_port
from impvm.operator import http
from impvm.operator.jithandout import (
    AUDIENCE,
    BEFORE_LAUNCH,
    NODE_NAME_EXTRA,
    Caller,
    JitHandout,
    SecretFacts,
    Verdict,
    VMFacts,
    judge,
)

REPO = Path(__file__).resolve().parents[2]
AGENT = f"system:serviceaccount:{AGENT_LEASE_NAMESPACE}:impvm-agent"
AGENTS = frozenset({AGENT})
APP_SECRET = "github-app"

# ---------------------------------------------------------------------------- the pure judgement


def _caller(
    node: str | None = "a", user: str = AGENT, ok: bool = True, audiences: tuple[str, ...] = ()
) -> Caller:
    extra = ((NODE_NAME_EXTRA, (node,)),) if node else ()
    return Caller(authenticated=ok, username=user, extra=extra, audiences=audiences or (AUDIENCE,))


VM = VMFacts(uid="u1", node="a", phase="Scheduled", secret="vm-jit")
SEC = SecretFacts(name="vm-jit", owner_uids=frozenset({"u1"}), has_value=True)


@pytest.mark.parametrize(
    ("caller", "vm", "secret", "verdict"),
    [
        (_caller(), VM, SEC, Verdict.GRANTED),
        (_caller(ok=False), VM, SEC, Verdict.UNAUTHENTICATED),
        # a review that does not name our audience (a server not audience aware) proves nothing
        (_caller(audiences=("https://kubernetes.default.svc",)), VM, SEC, Verdict.UNAUTHENTICATED),
        (_caller(user="system:serviceaccount:x:impvm-agent"), VM, SEC, Verdict.NOT_AN_AGENT),
        (_caller(node=None), VM, SEC, Verdict.NO_NODE),
        (_caller(node="b"), VM, SEC, Verdict.OTHER_NODE),
        (_caller(), None, SEC, Verdict.NO_VM),
        (_caller(), VMFacts("u1", "", "", "vm-jit"), SEC, Verdict.OTHER_NODE),  # unbound
        (_caller(), VMFacts("u1", "a", "Starting", "vm-jit"), SEC, Verdict.LAUNCHED),
        (_caller(), VMFacts("u1", "a", "Running", "vm-jit"), SEC, Verdict.LAUNCHED),
        (_caller(), VMFacts("u1", "a", "Failed", "vm-jit"), SEC, Verdict.LAUNCHED),
        (_caller(), VM, None, Verdict.NOT_YET),
        (_caller(), VMFacts("u1", "a", "", ""), None, Verdict.NOT_YET),
        # a Secret the VM does not own (the App Secret named by a forged VM) is never handed out
        (_caller(), VM, SecretFacts("vm-jit", frozenset({"u2"}), True), Verdict.NOT_YET),
        (_caller(), VM, SecretFacts("other", frozenset({"u1"}), True), Verdict.NOT_YET),
        (_caller(), VM, SecretFacts("vm-jit", frozenset({"u1"}), False), Verdict.NOT_YET),
    ],
)
def test_judge(
    caller: Caller, vm: VMFacts | None, secret: SecretFacts | None, verdict: Verdict
) -> None:
    assert judge(caller, AGENTS, vm, secret) is verdict


@given(
    ok=st.booleans(),
    user=st.sampled_from([AGENT, "system:serviceaccount:impvm-system:impvm-operator", "alice"]),
    node=st.sampled_from([None, "a", "b", ""]),
    vm_node=st.sampled_from(["", "a", "b"]),
    phase=st.sampled_from(["", "Pending", "Scheduled", "Starting", "Running", "Succeeded"]),
    name=st.sampled_from(["", "vm-jit", "github-app"]),
    owners=st.sets(st.sampled_from(["u1", "u2"])),
    has=st.booleans(),
    vm_exists=st.booleans(),
    sec_exists=st.booleans(),
)
def test_granted_only_to_the_agent_of_the_vms_node_before_launch(
    ok: bool,
    user: str,
    node: str | None,
    vm_node: str,
    phase: str,
    name: str,
    owners: set[str],
    has: bool,
    vm_exists: bool,
    sec_exists: bool,
) -> None:
    caller = Caller(ok, user, ((NODE_NAME_EXTRA, (node,)),) if node is not None else ())
    vm = VMFacts("u1", vm_node, phase, "vm-jit") if vm_exists else None
    sec = SecretFacts(name, frozenset(owners), has) if sec_exists else None
    granted = judge(caller, AGENTS, vm, sec) is Verdict.GRANTED
    expect = (
        ok
        and user == AGENT
        and bool(node)
        and vm is not None
        and vm_node == node
        and phase in BEFORE_LAUNCH
        and sec is not None
        and name == "vm-jit"
        and "u1" in owners
        and has
    )
    assert granted == expect


# ---------------------------------------------------------------------------- on the API server


@pytest.fixture
def rbac(kube: Client) -> Iterator[None]:
    """deploy/rbac applied to the shared control plane, and removed after the test (the chart's
    tests install the same names and refuse objects Helm does not own)."""
    applied = []
    for component in ("operator", "agent"):
        text = (REPO / "deploy" / "rbac" / f"{component}.yaml").read_text()
        for obj in load_all_yaml(text):
            kube.apply(obj, field_manager="impvm-test", force=True)
            applied.append(obj)
    yield
    for obj in reversed(applied):
        if obj.kind == "Namespace":
            continue
        with contextlib.suppress(ApiError):
            kube.delete(type(obj), obj.metadata.name, namespace=obj.metadata.namespace)


def _allowed(kube: Client, user: str, groups: list[str], attrs: dict[str, str]) -> bool:
    spec = SubjectAccessReviewSpec(
        user=user, groups=groups, resourceAttributes=ResourceAttributes(**attrs)
    )
    out = kube.create(SubjectAccessReview(spec=spec))
    assert out.status is not None
    return bool(out.status.allowed)


SA_GROUPS = [
    "system:serviceaccounts",
    f"system:serviceaccounts:{AGENT_LEASE_NAMESPACE}",
    "system:authenticated",
]


@pytest.mark.controlplane
def test_agent_cannot_read_any_secret(kube: Client, namespace: str, rbac: None) -> None:
    """SubjectAccessReviews as the agent's ServiceAccount: no get, list or watch of the App
    Secret or of a JIT Secret, in the pools' namespace or cluster-wide; and no way around it
    (minting tokens, impersonating, editing Nodes or the operator's TokenReviews)."""
    denied = []
    for verb in ("get", "list", "watch"):
        for ns, name in (
            (namespace, APP_SECRET),
            (namespace, "pool-abcde-0a1b2c-jit"),
            (AGENT_LEASE_NAMESPACE, APP_SECRET),
            ("", ""),
        ):
            attrs = {"verb": verb, "resource": "secrets", "namespace": ns, "name": name}
            if _allowed(kube, AGENT, SA_GROUPS, attrs):
                denied.append(attrs)
    for attrs in (
        {
            "verb": "create",
            "resource": "serviceaccounts",
            "subresource": "token",
            "namespace": AGENT_LEASE_NAMESPACE,
            "name": "impvm-agent",
        },
        {
            "verb": "create",
            "resource": "serviceaccounts",
            "subresource": "token",
            "namespace": AGENT_LEASE_NAMESPACE,
            "name": "impvm-operator",
        },
        {"verb": "impersonate", "resource": "serviceaccounts"},
        {"verb": "impersonate", "resource": "users"},
        {"verb": "create", "resource": "nodes"},
        {"verb": "patch", "resource": "nodes"},
        {"verb": "create", "group": "authentication.k8s.io", "resource": "tokenreviews"},
        {"verb": "create", "resource": "secrets", "namespace": namespace},
        {"verb": "create", "resource": "pods", "namespace": namespace},
    ):
        if _allowed(kube, AGENT, SA_GROUPS, attrs):
            denied.append(attrs)
    assert denied == [], f"the agent may: {denied}"
    # the review itself works: the agent may do what it needs, the operator may review tokens
    assert _allowed(
        kube,
        AGENT,
        SA_GROUPS,
        {"verb": "patch", "group": "imp.dev", "resource": "impvms", "namespace": namespace},
    )
    operator = f"system:serviceaccount:{AGENT_LEASE_NAMESPACE}:impvm-operator"
    assert _allowed(
        kube,
        operator,
        SA_GROUPS,
        {"verb": "create", "group": "authentication.k8s.io", "resource": "tokenreviews"},
    )


@pytest.fixture
async def handout(kube: Client, control_plane: ControlPlane, rbac: None) -> AsyncIterator[str]:
    """The operator's HTTP endpoint with the hand-out, acting as the operator's ServiceAccount,
    on a loopback port; yields its base URL."""
    cfg = service_account_kubeconfig(
        kube, control_plane.kubeconfig, AGENT_LEASE_NAMESPACE, "impvm-operator", create=False
    )
    client = AsyncClient(config=KubeConfig.from_dict(cfg))
    port = free_port()
    runner = await http.start(
        http.make_app(None, JitHandout(client, AGENTS).handle), "127.0.0.1", port
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await client.close()


@pytest.fixture
def nodes(kube: Client) -> Iterator[tuple[str, str]]:
    """Two Node objects (deleted afterwards)."""
    a, b = (f"node-{uuid.uuid4().hex[:6]}" for _ in range(2))
    for n in (a, b):
        kube.create(Node(metadata=ObjectMeta(name=n)))
    yield a, b
    for n in (a, b):
        kube.delete(Node, n)


def _vm_with_secret(kube: Client, namespace: str, name: str, node: str, value: str) -> None:
    vm = kube.create(
        ImpVMResource.from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ImpVM",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "classRef": {"name": "small"},
                    "image": "registry.example/base@sha256:" + "0" * 64,
                    "runnerLayer": "registry.example/layer@sha256:" + "1" * 64,
                    "nodeName": node,
                    "runnerConfigSecret": f"{name}-jit",
                },
            }
        )
    )
    owner = OwnerReference(
        apiVersion=API_VERSION, kind="ImpVM", name=name, uid=vm.metadata.uid, controller=True
    )
    kube.create(
        Secret(
            metadata=ObjectMeta(name=f"{name}-jit", namespace=namespace, ownerReferences=[owner]),
            data={JIT_SECRET_KEY: base64.b64encode(value.encode()).decode()},
        )
    )


def _phase(kube: Client, namespace: str, name: str, phase: str) -> None:
    kube.patch(
        ImpVMResource.Status,
        name,
        {"status": {"phase": phase}},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )


@pytest.mark.controlplane
async def test_an_agent_gets_its_own_nodes_jit_config_and_no_other(
    kube: Client, namespace: str, handout: str, nodes: tuple[str, str], tmp_path: Path
) -> None:
    a, b = nodes
    _vm_with_secret(kube, namespace, "vm-a", a, "jit-of-a")
    _vm_with_secret(kube, namespace, "vm-b", b, "jit-of-b")
    # an App Secret a forged VM could name: never handed out (not owned by the VM)
    kube.create(
        Secret(
            metadata=ObjectMeta(name=APP_SECRET, namespace=namespace),
            data={"github_app_private_key": base64.b64encode(b"not-a-key").decode()},
        )
    )
    token_a = tmp_path / "a.token"
    token_a.write_text(
        node_bound_token(kube, AGENT_LEASE_NAMESPACE, "impvm-agent", a, AUDIENCE, 600)
    )
    source = OperatorJitSource(handout, token_a)
    try:
        got = await source.jitconfig(namespace, "vm-a", "vm-a-jit")
        assert got is not None and got.reveal() == "jit-of-a"
        # node B's VM, over the same channel, with node A's token: refused
        with pytest.raises(JitSourceError, match="403") as refused:
            await source.jitconfig(namespace, "vm-b", "vm-b-jit")
        assert "jit-of-b" not in str(refused.value)
        with pytest.raises(JitSourceError, match="403"):
            await source.jitconfig(namespace, "no-such-vm", "x")

        async with httpx.AsyncClient() as h:
            path = f"/agents/v1/namespaces/{namespace}/impvms/vm-a/jitconfig"

            async def ask(token: str | None) -> httpx.Response:
                headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
                return await h.get(handout + path, headers=headers)

            assert (await ask(None)).status_code == 401
            assert (await ask("not-a-token")).status_code == 401
            # a token for the API server (no audience of ours) and an unbound one
            api_token = node_bound_token(
                kube, AGENT_LEASE_NAMESPACE, "impvm-agent", a, "https://kubernetes.default", 600
            )
            assert (await ask(api_token)).status_code == 401
            unbound = kube.create(
                ServiceAccountToken(
                    metadata=ObjectMeta(name="impvm-agent", namespace=AGENT_LEASE_NAMESPACE),
                    spec=TokenRequestSpec(audiences=[AUDIENCE], expirationSeconds=600),
                ),
                name="impvm-agent",
                namespace=AGENT_LEASE_NAMESPACE,
            )
            assert unbound.status is not None
            resp = await ask(unbound.status.token)
            assert resp.status_code == 403 and "node" in resp.json()["message"]
            # the operator's own ServiceAccount bound to node A is not an agent
            op_token = node_bound_token(
                kube, AGENT_LEASE_NAMESPACE, "impvm-operator", a, AUDIENCE, 600
            )
            resp = await ask(op_token)
            assert resp.status_code == 403 and "jit-of-a" not in resp.text
            ok = await ask(token_a.read_text())
            assert ok.status_code == 200 and ok.headers["Cache-Control"] == "no-store"
            # an encoded "/" in the name would address another API path: 404, no API call
            for bad in ("a%2Fb", "A", "a_b", "-a"):
                resp = await h.get(
                    f"{handout}/agents/v1/namespaces/{namespace}/impvms/{bad}/jitconfig",
                    headers={"Authorization": f"Bearer {token_a.read_text()}"},
                )
                assert resp.status_code == 404, (bad, resp.text)

        # once launched, not even its own node gets it again
        _phase(kube, namespace, "vm-a", "Starting")
        with pytest.raises(JitSourceError, match="409"):
            await source.jitconfig(namespace, "vm-a", "vm-a-jit")
    finally:
        await source.close()
