"""An agent holds its own node and nothing more, on a real API server with the shipped RBAC
(deploy/rbac) and admission policies (deploy/admission, the copies ``impvm up`` applies).

The identities are the ones the install paths use: a ServiceAccount token bound to a Node
object (``impvm up``, the development stack) and one bound to a Pod on a node (the chart's
projected token); the test first shows what the API server puts in their user info. With node
A's token every attack below is refused with a message, and what the agent legitimately does
(status, its Lease, its finalizer, Events; a whole VM run by the real agent) still works. The
agent binds nothing: the operator places VMs, so claiming an unbound VM is one of the attacks.
Credentials that name no node - an unbound token, a client certificate of the ServiceAccount
(what ``impvm up`` gave its agent before) - get no write at all.

The policies live on a control plane of this module only, so no other test runs under them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import ssl
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lightkube import AsyncClient, Client
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node, Secret, ServiceAccountToken
from lightkube.types import PatchType

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.jitsource import SecretJitSource
from impvm.agent.process import ProcessRuntime
from impvm.api.models import AGENT_FINALIZER, AGENT_LEASE_NAMESPACE, API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.kube.admin import admin_client, install_crds, node_bound_token, pod_bound_token
from impvm.kube.controlplane import ControlPlane
from impvm.kube.events import EventRecorder
from impvm.up.manifests import policy_manifest, rbac_manifest
from tests.runtime_fixtures import Images

pytestmark = [pytest.mark.controlplane]

NS = AGENT_LEASE_NAMESPACE
AGENT_SA = "impvm-agent"
AGENT_USER = f"system:serviceaccount:{NS}:{AGENT_SA}"
SA_GROUPS = ["system:serviceaccounts", f"system:serviceaccounts:{NS}"]
OTHER_FINALIZER = "example.com/keep"
IMAGE = "registry.example/base@sha256:" + "0" * 64
LAYER = "registry.example/layer@sha256:" + "1" * 64


class Guarded:
    """The module's control plane with the shipped RBAC and policies; clients per identity."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.kube = admin_client(cp.kubeconfig)
        self.namespace = f"t-{uuid.uuid4().hex[:8]}"

    def kubeconfig(self, credentials: dict[str, str]) -> dict[str, Any]:
        admin = yaml.safe_load(self.cp.kubeconfig.read_text())
        cluster = admin["clusters"][0]
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": "u", "user": credentials}],
            "contexts": [{"name": "u", "context": {"cluster": cluster["name"], "user": "u"}}],
            "current-context": "u",
        }

    def token_for_node(self, node: str) -> str:
        """What ``impvm up`` gives node ``node``'s agent: a token bound to its Node object."""
        return node_bound_token(self.kube, NS, AGENT_SA, node, None, 3600)

    def token_for_pod(self, node: str) -> str:
        """What the kubelet projects into the chart's agent pod on ``node``: a token bound
        to that pod (the API server adds the pod's node)."""
        return pod_bound_token(self.kube, NS, AGENT_SA, node)

    def unbound_token(self) -> str:
        return self._token(TokenRequestSpec(audiences=[], expirationSeconds=3600))

    def _token(self, spec: TokenRequestSpec) -> str:
        req = ServiceAccountToken(metadata=ObjectMeta(name=AGENT_SA, namespace=NS), spec=spec)
        out = self.kube.create(req, name=AGENT_SA, namespace=NS)
        assert out.status is not None
        return out.status.token

    def client(self, token: str) -> Client:
        return Client(config=KubeConfig.from_dict(self.kubeconfig({"token": token})))

    def certificate_client(self, tmp_path: Path) -> Client:
        """The ServiceAccount's user and groups in a client certificate: RBAC sees the agent,
        but no node (what ``impvm up`` used to give its agent)."""
        path = self.cp.client_kubeconfig(tmp_path / "agent-cert.kubeconfig", AGENT_USER, SA_GROUPS)
        return Client(config=KubeConfig.from_file(str(path)))

    def whoami(self, token: str) -> dict[str, Any]:
        """The user info the API server derives from ``token`` (a SelfSubjectReview)."""
        tls = ssl.create_default_context(cafile=str(self.cp.pki / "ca.crt"))
        resp = httpx.post(
            self.cp.url + "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            headers={"Authorization": f"Bearer {token}"},
            verify=tls,
            timeout=30,
        )
        assert resp.status_code == 201, resp.text
        info: dict[str, Any] = resp.json()["status"]["userInfo"]
        return info

    def node(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            self.kube.create(Node(metadata=ObjectMeta(name=name)))

    def vm(self, name: str, node: str | None = None, *, layer: str = LAYER,
           image: str = IMAGE, **extra: str) -> None:  # fmt: skip
        """A VM of class ``small`` (bound to ``node``) carrying another controller's finalizer."""
        spec: dict[str, Any] = {
            "classRef": {"name": "small"}, "image": image, "runnerLayer": layer, **extra
        }  # fmt: skip
        if node:
            spec["nodeName"] = node
        meta = {"name": name, "namespace": self.namespace, "finalizers": [OTHER_FINALIZER]}
        self.kube.create(
            ImpVMResource.from_dict(
                {"apiVersion": API_VERSION, "kind": "ImpVM", "metadata": meta, "spec": spec}
            )
        )

    def get_vm(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.kube.get(ImpVMResource, name, namespace=self.namespace).to_dict()
        return got


def refused(call: Callable[[], object]) -> str:
    """Run a write that must be refused; the API server's message."""
    with pytest.raises(ApiError) as exc:
        call()
    assert exc.value.status.code in (403, 422), exc.value.status
    return exc.value.status.message or ""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("guarded-cp")).start()
    try:
        g = Guarded(cp)
        install_crds(g.kube)
        for text in (rbac_manifest("operator"), rbac_manifest("agent"), policy_manifest()):
            for obj in load_all_yaml(text):
                g.kube.apply(obj, force=True)
        from lightkube.resources.core_v1 import Namespace

        g.kube.create(Namespace(metadata=ObjectMeta(name=g.namespace)))
        g.kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVMClass",
                    "metadata": {"name": "small"},
                    "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1},
                }
            )
        )
        # the policies take effect once the API server has loaded them: wait for a refusal
        probe = g.client(g.unbound_token())
        lease = Lease(metadata=ObjectMeta(name="impvm-agent-probe", namespace=NS), spec=LeaseSpec())
        for _ in range(600):
            try:
                probe.create(lease, dry_run=True)
            except ApiError as e:
                if "ValidatingAdmissionPolicy" in (e.status.message or ""):
                    break
            asyncio.run(asyncio.sleep(0.1))
        else:
            raise AssertionError("the agent policies never took effect")
        yield g
    finally:
        cp.stop()


def patch(client: Client, g: Guarded, name: str, body: dict[str, Any], status: bool = False) -> Any:
    res = ImpVMResource.Status if status else ImpVMResource
    return client.patch(res, name, body, namespace=g.namespace, patch_type=PatchType.MERGE)


def lease_body(name: str, holder: str, annotations: dict[str, str] | None = None) -> Lease:
    return Lease(
        metadata=ObjectMeta(name=name, namespace=NS, annotations=annotations),
        spec=LeaseSpec(holderIdentity=holder, renewTime=dt.datetime.now(dt.UTC)),
    )


def test_the_api_server_names_the_node_of_node_and_pod_bound_tokens(guarded: Guarded) -> None:
    """What our 1.34 API server really puts in the user info: the node of a Node-bound token
    (``impvm up``) and of a Pod-bound one (the chart's projected token, the pod's node); an
    unbound token names none."""
    g = guarded
    g.node("node-a")
    node_bound = g.whoami(g.token_for_node("node-a"))
    pod_bound = g.whoami(g.token_for_pod("node-a"))
    unbound = g.whoami(g.unbound_token())
    for info in (node_bound, pod_bound, unbound):
        assert info["username"] == AGENT_USER
    key = "authentication.kubernetes.io/node-name"
    assert node_bound["extra"][key] == ["node-a"]
    assert pod_bound["extra"][key] == ["node-a"]
    assert "authentication.kubernetes.io/pod-name" in pod_bound["extra"]
    assert key not in unbound.get("extra", {})


@pytest.mark.parametrize("binding", ["node", "pod"])
def test_an_agent_of_node_a_cannot_touch_what_is_not_its_nodes(
    guarded: Guarded, binding: str
) -> None:
    g = guarded
    a, b = f"node-a-{binding}", f"node-b-{binding}"
    for n in (a, b):
        g.node(n)
    agent = g.client(g.token_for_node(a) if binding == "node" else g.token_for_pod(a))
    mine, theirs, free = f"mine-{binding}", f"theirs-{binding}", f"free-{binding}"
    g.vm(mine, a)
    g.vm(theirs, b)
    g.vm(free)
    # the operator's leader Lease, with the URL standbys forward webhook deliveries to
    g.kube.apply(
        lease_body("impvm-operator", "operator-0", {"imp.dev/leader-url": "http://10.0.0.5:8080"}),
        field_manager="impvm-operator",
        force=True,
    )
    g.kube.apply(lease_body(f"impvm-agent-{b}", b), field_manager="impvm-agent", force=True)

    messages: dict[str, str] = {}

    def attack(what: str, call: Callable[[], object]) -> None:
        messages[what] = refused(call)

    # Leases: the operator's leader Lease and another node's
    leader = g.kube.get(Lease, "impvm-operator", namespace=NS)
    assert leader.metadata is not None and leader.metadata.annotations is not None
    leader.metadata.annotations["imp.dev/leader-url"] = "http://attacker.example"
    attack("repoint the leader", lambda: agent.replace(leader))
    attack(
        "stop the leader",
        lambda: agent.patch(
            Lease, "impvm-operator", {"spec": {"holderIdentity": a}}, namespace=NS,
            patch_type=PatchType.MERGE,
        ),
    )  # fmt: skip
    attack(
        "renew node B's Lease",
        lambda: agent.apply(
            lease_body(f"impvm-agent-{b}", b), field_manager="impvm-agent", force=True
        ),
    )
    attack(
        "create a Lease for node C",
        lambda: agent.create(lease_body("impvm-agent-node-c", "node-c")),
    )
    attack(
        "hold its own Lease as node B",
        lambda: agent.apply(
            lease_body(f"impvm-agent-{a}", b), field_manager="impvm-agent", force=True
        ),
    )
    eternal = lease_body(f"impvm-agent-{a}", a)
    assert eternal.spec is not None
    eternal.spec.leaseDurationSeconds = 10**8  # alive for three years on one renewal
    attack(
        "renew its own Lease for years",
        lambda: agent.apply(eternal, field_manager="impvm-agent", force=True),
    )
    # ImpVM specs: its own VM's and node B's
    for vm in (mine, theirs):
        attack(
            f"image of {vm}",
            lambda vm=vm: patch(agent, g, vm, {"spec": {"image": "evil@sha256:" + "2" * 64}}),
        )  # type: ignore[misc]
        attack(
            f"runnerLayer of {vm}",
            lambda vm=vm: patch(agent, g, vm, {"spec": {"runnerLayer": "evil:latest"}}),
        )  # type: ignore[misc]
        attack(
            f"allowUnpinnedImages of {vm}",
            lambda vm=vm: patch(agent, g, vm, {"spec": {"allowUnpinnedImages": True}}),
        )  # type: ignore[misc]
    attack("claim an unbound VM", lambda: patch(agent, g, free, {
        "metadata": {"finalizers": [AGENT_FINALIZER]}, "spec": {"nodeName": a}
    }))  # fmt: skip
    attack("claim without the finalizer", lambda: patch(
        agent, g, free, {"spec": {"nodeName": a}}
    ))  # fmt: skip
    attack("claim with another image", lambda: patch(
        agent, g, free, {"spec": {"nodeName": a, "image": "evil@sha256:" + "2" * 64}}
    ))  # fmt: skip
    # status of node B's VM and of an unbound one
    attack(
        "status of node B's VM",
        lambda: patch(agent, g, theirs, {"status": {"phase": "Failed"}}, True),
    )
    attack(
        "status of an unbound VM",
        lambda: patch(agent, g, free, {"status": {"phase": "Running"}}, True),
    )
    # binding: unbind its own VM, bind a VM to node B, move node B's VM
    attack("unbind its VM", lambda: patch(agent, g, mine, {"spec": {"nodeName": ""}}))
    attack("bind a VM to node B", lambda: patch(agent, g, free, {"spec": {"nodeName": b}}))
    attack("take node B's VM", lambda: patch(agent, g, theirs, {"spec": {"nodeName": a}}))
    # finalizers: another one, on its own VM; its own, on node B's VM
    attack("remove another finalizer", lambda: patch(
        agent, g, mine, {"metadata": {"finalizers": [AGENT_FINALIZER]}}
    ))  # fmt: skip
    attack("release node B's VM", lambda: patch(agent, g, theirs, {"metadata": {"finalizers": []}}))
    attack("claim dropping a finalizer", lambda: patch(
        agent, g, free, {"metadata": {"finalizers": [AGENT_FINALIZER]}, "spec": {"nodeName": a}}
    ))  # fmt: skip
    attack(
        "relabel its VM",
        lambda: patch(agent, g, mine, {"metadata": {"labels": {"imp.dev/runner-pool": "x"}}}),
    )

    # an Event passed off as node B's
    ev = Event(
        metadata=ObjectMeta(generateName="x.", namespace=g.namespace),
        involvedObject={"kind": "ImpVM", "name": theirs, "namespace": g.namespace},  # type: ignore[arg-type]
        reason="Forged",
        message="node B did this",
        source={"component": "impvm-agent", "host": b},  # type: ignore[arg-type]
        reportingComponent="impvm-agent",
        reportingInstance=b,
    )
    attack("an Event as node B", lambda: agent.create(ev))

    for what, msg in messages.items():
        assert msg, what  # every refusal says why
    assert "writes only the Lease impvm-agent-" in messages["repoint the leader"]
    assert "not impvm-operator" in messages["stop the leader"]
    assert f"not impvm-agent-{b}" in messages["renew node B's Lease"]
    assert "held by that node" in messages["hold its own Lease as node B"]
    assert "at most 300 s" in messages["renew its own Lease for years"]
    assert "an agent changes no field of an ImpVM's spec" in messages[f"image of {mine}"]
    for what in ("claim an unbound VM", "claim without the finalizer", "claim with another image"):
        assert "the operator binds VMs" in messages[what], what
    assert f"bound to node {b}" in messages[f"image of {theirs}"]
    assert f"bound to node {b}" in messages["status of node B's VM"]
    assert "bound to no node" in messages["status of an unbound VM"]
    assert "nodeName" in messages["unbind its VM"]
    assert "bound to no node" in messages["bind a VM to node B"]
    assert "its own finalizer imp.dev/agent only" in messages["remove another finalizer"]
    assert "label" in messages["relabel its VM"]
    assert "reports Events as that node" in messages["an Event as node B"]

    # nothing changed
    assert g.get_vm(mine)["spec"] == {**g.get_vm(mine)["spec"], "image": IMAGE, "nodeName": a}
    assert g.get_vm(theirs)["metadata"]["finalizers"] == [OTHER_FINALIZER]
    assert not g.get_vm(free)["spec"].get("nodeName")
    assert (g.get_vm(theirs).get("status") or {}).get("phase") is None
    after = g.kube.get(Lease, "impvm-operator", namespace=NS)
    assert after.metadata is not None and after.metadata.annotations is not None
    assert after.metadata.annotations["imp.dev/leader-url"] == "http://10.0.0.5:8080"
    assert after.spec is not None and after.spec.holderIdentity == "operator-0"


@pytest.mark.parametrize("binding", ["node", "pod"])
def test_what_an_agent_does_for_its_node_still_works(guarded: Guarded, binding: str) -> None:
    """On a VM the operator bound to its node: its finalizer added (admission), status, its own
    Lease, its finalizer's removal and Events reported as its node: accepted."""
    g = guarded
    a = f"node-ok-{binding}"
    g.node(a)
    agent = g.client(g.token_for_node(a) if binding == "node" else g.token_for_pod(a))
    name = f"bound-{binding}"
    g.vm(name, a)
    vm = g.get_vm(name)
    patch(agent, g, name, {
        "metadata": {"resourceVersion": vm["metadata"]["resourceVersion"],
                     "finalizers": [OTHER_FINALIZER, AGENT_FINALIZER]},
    })  # fmt: skip
    patch(agent, g, name, {"status": {"phase": "Running", "message": "ok"}}, True)
    agent.apply(lease_body(f"impvm-agent-{a}", a), field_manager="impvm-agent", force=True)
    agent.apply(lease_body(f"impvm-agent-{a}", a), field_manager="impvm-agent", force=True)
    patch(agent, g, name, {"metadata": {"finalizers": [OTHER_FINALIZER]}})
    got = g.get_vm(name)
    assert got["spec"]["nodeName"] == a and got["status"]["phase"] == "Running"
    assert got["metadata"]["finalizers"] == [OTHER_FINALIZER]
    recorder = EventRecorder(
        AsyncClient(config=KubeConfig.from_dict(g.kubeconfig({"token": g.token_for_node(a)}))),
        component="impvm-agent",
        host=a,
    )
    asyncio.run(
        recorder.record(
            api_version=API_VERSION, kind="ImpVM", namespace=g.namespace, name=name,
            uid=got["metadata"]["uid"], reason="Admitted", message=f"admitted by {a}",
        )
    )  # fmt: skip
    events = g.kube.list(Event, namespace=g.namespace, fields={"involvedObject.name": name})
    assert [e.reportingInstance for e in events] == [a]


def test_credentials_that_name_no_node_write_nothing(guarded: Guarded, tmp_path: Path) -> None:
    """An unbound token of the agent's ServiceAccount, and a client certificate with its user
    name: RBAC allows the writes, the policies refuse every one."""
    g = guarded
    g.vm("unnamed-free")
    g.vm("unnamed-bound", "node-x")
    for client in (g.client(g.unbound_token()), g.certificate_client(tmp_path)):
        msgs = [
            refused(lambda c=client: c.apply(lease_body("impvm-agent-node-x", "node-x"),
                                              field_manager="impvm-agent", force=True)),  # type: ignore[misc]
            refused(lambda c=client: patch(c, g, "unnamed-free", {"spec": {"nodeName": "node-x"}})),  # type: ignore[misc]
            refused(lambda c=client: patch(c, g, "unnamed-bound", {"status": {"phase": "Failed"}}, True)),  # type: ignore[misc]
        ]  # fmt: skip
        assert all("name no node" in m for m in msgs), msgs


async def test_the_real_agent_runs_a_vm_under_the_policies(
    guarded: Guarded, images: Images, tmp_path: Path
) -> None:
    """The agent itself, as node A's token (Node-bound, as ``impvm up`` runs it), with the
    process runtime: it advertises its Lease, admits the VM bound to its node, reports it up to its exit
    (the probe runner exits 3: Failed), and releases it (its finalizer) once done - every
    write passing the policies."""
    g = guarded
    node = "node-run"
    g.node(node)
    g.kube.create(
        Secret(
            metadata=ObjectMeta(name="run-me-jit", namespace=g.namespace),
            data={JIT_SECRET_KEY: base64.b64encode(b"jit-not-a-real-one").decode()},
        )
    )
    g.vm("run-me", node, layer=images.probe, image=images.base, runnerConfigSecret="run-me-jit")
    token = tmp_path / "api.token"
    token.write_text(g.token_for_node(node))
    client = AsyncClient(
        config=KubeConfig.from_dict(g.kubeconfig({"tokenFile": str(token)})),
        field_manager="impvm-agent",
    )
    admin = AsyncClient(config=KubeConfig.from_file(str(g.cp.kubeconfig)))
    store = ImageStore(tmp_path / "cache", 1 << 30, {images.registry})
    agent = Agent(
        client,
        ProcessRuntime(store),
        AgentConfig(
            node_name=node,
            capacity=Resources(2, 2048),
            workdir=tmp_path / "agent",
            tick_seconds=0.2,
            stop_grace_seconds=2.0,
        ),
        jit=SecretJitSource(admin),  # the runner layer here does not use a JIT config
    )
    task = asyncio.create_task(agent.run())
    try:

        async def phase() -> str | None:
            vm = (await admin.get(ImpVMResource, "run-me", namespace=g.namespace)).to_dict()
            return (vm.get("status") or {}).get("phase")

        for _ in range(900):
            if await phase() == "Failed":
                break
            assert not task.done(), task
            await asyncio.sleep(0.2)
        vm = g.get_vm("run-me")
        assert vm["spec"]["nodeName"] == node and vm["status"]["phase"] == "Failed"
        assert vm["status"].get("exitCode") == 3, json.dumps(vm["status"])
        lease = await admin.get(Lease, f"impvm-agent-{node}", namespace=NS)
        assert lease.spec is not None and lease.spec.holderIdentity == node
        # done with it: the agent cleans up and takes its finalizer off (the other one stays)
        for _ in range(300):
            fins = g.get_vm("run-me")["metadata"].get("finalizers") or []
            if AGENT_FINALIZER not in fins:
                break
            await asyncio.sleep(0.2)
        assert g.get_vm("run-me")["metadata"]["finalizers"] == [OTHER_FINALIZER]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        await admin.close()
