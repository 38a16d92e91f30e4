"""charts/impvm on the real kube-apiserver of the test control plane: the rendered chart (with
the defaults and with every value set) is accepted by a server-side dry run, helm's own install
dry run works against it, the operator's pod meets the "restricted" Pod Security Standard, and
access reviews of the chart's ServiceAccounts show each can do its job and nothing else."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from lightkube import Client
from lightkube.codecs import from_dict
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.resources.scheduling_v1 import PriorityClass

from impvm.kube.admin import pod_bound_token
from impvm.kube.controlplane import ControlPlane
from tests.conftest import REPO

from .conftest import CHART, FULL_VALUES, NAMESPACE, NODE_POOLS, Helm, Kubectl, one

pytestmark = [pytest.mark.controlplane]


@pytest.fixture(scope="module")
def priority_class(kube: Client) -> Iterator[str]:
    """The PriorityClass full-values.yaml names (the Priority admission plugin checks it)."""
    name = "impvm-test-critical"
    kube.create(PriorityClass(metadata=ObjectMeta(name=name), value=1000000))
    yield name
    kube.delete(PriorityClass, name)


@pytest.fixture(scope="module")
def servicemonitor_crd(kubectl: Kubectl) -> Iterator[None]:
    """The Prometheus Operator's ServiceMonitor CRD, generated from its Go types by
    scripts/build-servicemonitor-crd.sh (cached), installed for the chart's ServiceMonitor."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-servicemonitor-crd.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    crd = proc.stdout.strip().splitlines()[-1]
    # established, and its storage serving (a fresh CRD answers 429 "storage is (re)initializing"
    # for a moment)
    last = ""
    for _ in range(60):
        steps = (
            ("apply", "--server-side", "-f", crd),
            ("wait", "--for=condition=Established", "--timeout=30s", "-f", crd),
            ("get", "servicemonitors.monitoring.coreos.com", "-A"),
        )
        for step in steps:
            p = kubectl.run(*step, check=False)
            if p.returncode != 0:
                last = p.stderr
                break
        else:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the ServiceMonitor CRD did not become usable: {last}")
    yield
    kubectl.run("delete", "--wait=false", "-f", crd)


def _dry_run(kubectl: Kubectl, rendered: str) -> str:
    proc = kubectl.run(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=helm",
        # objects of the same name another test's stack applied (the shared control plane)
        # are not the chart's problem: a dry run only asks whether the server accepts them
        "--force-conflicts",
        "-f",
        "-",
        stdin=rendered,
        check=False,
    )
    assert proc.returncode == 0, f"the API server refused the chart:\n{proc.stderr}"
    return proc.stdout


def test_defaults_accepted_by_server_side_dry_run(
    helm: Helm, kubectl: Kubectl, release_namespace: str
) -> None:
    out = _dry_run(kubectl, helm.template_text("--include-crds"))
    for obj in (
        "deployment.apps/impvm-operator",
        "daemonset.apps/impvm-agent",
        "service/impvm-operator",
        "clusterrole.rbac.authorization.k8s.io/impvm-operator",
        "role.rbac.authorization.k8s.io/impvm-agent-leases",
        "customresourcedefinition.apiextensions.k8s.io/impvmrunnerpools.imp.dev",
    ):
        assert f"{obj} serverside-applied (server dry run)" in out, out


def test_full_values_accepted_by_server_side_dry_run(
    helm: Helm,
    kubectl: Kubectl,
    release_namespace: str,
    priority_class: str,
    servicemonitor_crd: None,
) -> None:
    out = _dry_run(kubectl, helm.template_text("--values", str(FULL_VALUES)))
    for obj in (
        "deployment.apps/impvm-full-operator",
        "daemonset.apps/impvm-full-agent",
        "ingress.networking.k8s.io/impvm-full-webhook",
        "servicemonitor.monitoring.coreos.com/impvm-full-operator",
    ):
        assert f"{obj} serverside-applied (server dry run)" in out, out


def test_node_pools_in_another_namespace_accepted_by_server_side_dry_run(
    helm: Helm, kubectl: Kubectl
) -> None:
    """A release in "default" with two VM node pools: the API server accepts both agent
    DaemonSets (their tolerations, sizes and selectors) and the release's RBAC there."""
    rendered = helm.run(
        "template", "impvm", str(CHART), "-n", "default", "--values", str(NODE_POOLS)
    ).stdout
    out = _dry_run(kubectl, rendered)
    for obj in (
        "deployment.apps/impvm-operator",
        "daemonset.apps/impvm-agent-small",
        "daemonset.apps/impvm-agent-large",
        "role.rbac.authorization.k8s.io/impvm-agent-leases",
    ):
        assert f"{obj} serverside-applied (server dry run)" in out, out
    assert "daemonset.apps/impvm-agent " not in out


def test_servicemonitor_checked_by_its_schema(
    helm: Helm, kubectl: Kubectl, release_namespace: str, servicemonitor_crd: None
) -> None:
    """The dry run checks against the CRD's real schema: the chart's ServiceMonitor passes, the
    same with a scheme outside the CRD's enum is refused."""
    rendered = helm.template_text(
        "--set",
        "operator.serviceMonitor.enabled=true",
        "--show-only",
        "templates/operator-servicemonitor.yaml",
    )
    _dry_run(kubectl, rendered)
    broken = rendered.replace("path: /metrics", "path: /metrics\n      scheme: gopher")
    proc = kubectl.run(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=broken, check=False
    )
    assert proc.returncode != 0 and "scheme" in proc.stderr, proc.stderr


def test_invalid_rendering_is_refused(helm: Helm, kubectl: Kubectl, release_namespace: str) -> None:
    """The dry run is a real check: a value the schema allows but the API server does not
    (a label value with spaces) is refused with the field named."""
    rendered = helm.template_text("--set-string", "operator.podLabels.team=not a label")
    proc = kubectl.run(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=rendered, check=False
    )
    assert proc.returncode != 0
    assert "spec.template.labels" in proc.stderr or "metadata.labels" in proc.stderr, proc.stderr


def test_helm_install_dry_run_against_the_api_server(
    helm: Helm, control_plane: ControlPlane, release_namespace: str
) -> None:
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}

    def install(*args: str) -> str:
        proc = subprocess.run(
            [
                str(helm.path),
                "install",
                "impvm",
                str(CHART),
                "-n",
                NAMESPACE,
                "--dry-run=server",
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    notes = install()
    assert "pulled by tag, not by digest" in notes
    assert "kubectl label node NODE imp.dev/agent=true" in notes
    assert "POST /webhooks/github" in notes
    pinned = install(
        "--set",
        "operator.image.digest=sha256:" + "a" * 64,
        "--set",
        "agent.image.digest=sha256:" + "b" * 64,
    )
    assert "pulled by tag" not in pinned


def test_operator_pod_meets_the_restricted_pod_security_standard(helm: Helm, kube: Client) -> None:
    """Pod Security Admission (built into the API server) enforces "restricted" on a namespace:
    the operator's pod is admitted there; the agent's (root, hostPath devices, capabilities)
    is refused, which is why the agent needs a namespace that allows privileged pods."""
    ns = f"psa-{uuid.uuid4().hex[:8]}"
    kube.create(
        Namespace(
            metadata=ObjectMeta(
                name=ns, labels={"pod-security.kubernetes.io/enforce": "restricted"}
            )
        )
    )
    try:
        docs = helm.template()
        for kind, name, admitted in (
            ("Deployment", "impvm-operator", True),
            ("DaemonSet", "impvm-agent", False),
        ):
            tmpl = one(docs, kind, name)["spec"]["template"]
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "labels": tmpl["metadata"]["labels"]},
                "spec": {**tmpl["spec"], "serviceAccountName": "default"},
            }
            try:
                kube.create(from_dict(pod), dry_run=True)
                ok, why = True, ""
            except ApiError as e:
                ok, why = False, e.status.message or ""
            assert ok is admitted, (name, why)
            if not admitted:
                assert 'violates PodSecurity "restricted' in why, why
    finally:
        kube.delete(Namespace, ns)


# ------------------------------------------------------------------ access reviews

#: What each component's code does with the API (verbs per (group, resource)), written from the
#: code, not from the RBAC files: operator (impvm.operator: kopf watches pools, the pool pass
#: creates/deletes VMs, mints JIT Secrets, records Events, reads agent Leases; kopf discovers
#: CRDs; the JIT config hand-out reviews agents' tokens) and agent (impvm.agent: claims VMs with
#: a patch, writes their status, records Events, renews its Lease, reads Nodes and ServiceCIDRs to
#: keep guests from the cluster's networks; it reads no Secret at all: its JIT configs come from
#: the operator's hand-out).
OPERATOR: dict[tuple[str, str], set[str]] = {
    ("imp.dev", "impvmrunnerpools"): {"get", "list", "watch", "patch"},
    ("imp.dev", "impvmrunnerpools/status"): {"get", "patch"},
    ("imp.dev", "impvmtemplates"): {"get", "list", "watch"},
    ("imp.dev", "impvmclasses"): {"get", "list", "watch"},
    ("imp.dev", "impvms"): {"get", "list", "watch", "create", "patch", "delete"},
    ("imp.dev", "impvms/status"): {"get", "patch"},
    ("", "secrets"): {"get", "list", "watch", "create"},
    ("", "namespaces"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("coordination.k8s.io", "leases"): {"get", "list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("authentication.k8s.io", "tokenreviews"): {"create"},
}
AGENT: dict[tuple[str, str], set[str]] = {
    ("imp.dev", "impvms"): {"get", "list", "watch", "patch"},
    ("imp.dev", "impvms/status"): {"get", "patch"},
    ("imp.dev", "impvmclasses"): {"get", "list", "watch"},
    ("", "nodes"): {"get", "list", "watch"},  # the networks no VM reaches
    ("networking.k8s.io", "servicecidrs"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
#: the operator's leader-election Lease, in the release namespace only (get and update of the
#: Lease impvm-operator only: see test_the_operator_updates_only_its_own_lease)
OPERATOR_IN_RELEASE_NAMESPACE: dict[tuple[str, str], set[str]] = {
    ("coordination.k8s.io", "leases"): {"get", "list", "watch", "create"},
    # VM pods, made in the release namespace only (never in a tenant's)
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
}
#: the agent's Lease, in the release namespace only
AGENT_IN_RELEASE_NAMESPACE: dict[tuple[str, str], set[str]] = {
    ("coordination.k8s.io", "leases"): {"get", "create", "update", "patch"},
}
#: verbs RBAC knows that discovery does not list
SPECIAL = [
    ("rbac.authorization.k8s.io", "clusterroles", "escalate"),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
    ("rbac.authorization.k8s.io", "roles", "escalate"),
    ("rbac.authorization.k8s.io", "roles", "bind"),
    ("", "serviceaccounts", "impersonate"),
    ("", "users", "impersonate"),
    ("", "groups", "impersonate"),
    ("certificates.k8s.io", "signers", "approve"),
    ("certificates.k8s.io", "signers", "sign"),
]


def _api_resources(kubectl: Kubectl) -> list[tuple[str, str, bool, set[str]]]:
    """(group, resource incl. subresource, namespaced, verbs) of every resource the API server
    serves (its discovery documents, preferred versions)."""
    out = []
    groups: list[tuple[str, str]] = [("", "/api/v1")]
    for g in kubectl.raw("/apis")["groups"]:
        groups.append((g["name"], f"/apis/{g['preferredVersion']['groupVersion']}"))
    for group, path in groups:
        for r in kubectl.raw(path)["resources"]:
            out.append((group, r["name"], bool(r["namespaced"]), set(r.get("verbs") or [])))
    return out


def _allowed(kube: Client, user: str, namespace: str, group: str, resource: str, verb: str) -> bool:
    res, _, sub = resource.partition("/")
    sa_ns = user.split(":")[2] if user.startswith("system:serviceaccount:") else ""
    spec = SubjectAccessReviewSpec(
        user=user,
        groups=[
            "system:serviceaccounts",
            f"system:serviceaccounts:{sa_ns}",
            "system:authenticated",
        ],
        resourceAttributes=ResourceAttributes(
            namespace=namespace or None,
            verb=verb,
            group=group,
            resource=res,
            subresource=sub or None,
        ),
    )
    status = kube.create(SubjectAccessReview(spec=spec)).status
    assert status is not None
    return bool(status.allowed)


def _permissions(
    kube: Client,
    user: str,
    namespace: str,
    resources: list[tuple[str, str, bool, set[str]]],
) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) ``user`` may use in ``namespace`` ("": cluster scope)."""
    checks = [(g, r, v) for g, r, _namespaced, verbs in resources for v in verbs]
    checks += SPECIAL
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = pool.map(lambda c: _allowed(kube, user, namespace, *c), checks)
        return {c for c, ok in zip(checks, answers, strict=True) if ok}


def _flat(table: dict[tuple[str, str], set[str]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for (g, r), verbs in table.items() for v in verbs}


@pytest.fixture(scope="module")
def chart_rbac(helm: Helm, kubectl: Kubectl, release_namespace: str) -> Iterator[str]:
    """The chart's ServiceAccounts and RBAC, really created (release ``review``); yields the
    name prefix."""
    rendered = helm.template_text(
        "--show-only",
        "templates/operator-rbac.yaml",
        "--show-only",
        "templates/agent-rbac.yaml",
        release="review",
    )
    kubectl.run("apply", "--server-side", "-f", "-", stdin=rendered)
    try:
        yield "review-impvm"
    finally:
        kubectl.run("delete", "--wait=false", "-f", "-", stdin=rendered)


def test_service_accounts_can_do_their_job_and_nothing_else(
    kube: Client, kubectl: Kubectl, chart_rbac: str, namespace: str
) -> None:
    resources = _api_resources(kubectl)
    served = {(g, r) for g, r, _, _ in resources}
    for table in (OPERATOR, AGENT, AGENT_IN_RELEASE_NAMESPACE, OPERATOR_IN_RELEASE_NAMESPACE):
        assert set(table) <= served, set(table) - served  # the tables name real resources

    # what any ServiceAccount may do without a binding (discovery, self reviews): allowed to all
    baseline_user = f"system:serviceaccount:{NAMESPACE}:nobody-{uuid.uuid4().hex[:6]}"
    sa = f"system:serviceaccount:{NAMESPACE}:{chart_rbac}"
    for where in (NAMESPACE, namespace, ""):
        baseline = _permissions(kube, baseline_user, where, resources)
        operator = _permissions(kube, f"{sa}-operator", where, resources) - baseline
        agent = _permissions(kube, f"{sa}-agent", where, resources) - baseline
        # cluster-wide roles: the same answer in every namespace and at cluster scope, except
        # that namespaced-only checks at cluster scope mean "in all namespaces"
        want_operator = _flat(OPERATOR) | (
            _flat(OPERATOR_IN_RELEASE_NAMESPACE) if where == NAMESPACE else set()
        )
        assert operator == want_operator, (where, _diff(operator, want_operator))
        want_agent = _flat(AGENT) | (
            _flat(AGENT_IN_RELEASE_NAMESPACE) if where == NAMESPACE else set()
        )
        assert agent == want_agent, (where, _diff(agent, want_agent))


def test_the_operator_updates_only_its_own_lease(kube: Client, chart_rbac: str) -> None:
    """The operator's leader election needs its own Lease; the agents' Leases in the same
    namespace are theirs (the operator only reads them)."""
    user = f"system:serviceaccount:{NAMESPACE}:{chart_rbac}-operator"

    def may(verb: str, name: str) -> bool:
        spec = SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"],
            resourceAttributes=ResourceAttributes(
                namespace=NAMESPACE, verb=verb, group="coordination.k8s.io", resource="leases",
                name=name,
            ),
        )  # fmt: skip
        status = kube.create(SubjectAccessReview(spec=spec)).status
        assert status is not None
        return bool(status.allowed)

    assert may("update", "impvm-operator") and may("get", "impvm-operator")
    assert not may("update", "impvm-agent-node-1")
    assert not may("patch", "impvm-operator") and not may("delete", "impvm-operator")


def test_the_charts_agent_writes_only_for_its_node(
    helm: Helm, kube: Client, kubectl: Kubectl, chart_rbac: str
) -> None:
    """The chart's agent, with the token the kubelet projects into its pod (bound to the pod,
    so to its node): the chart's admission policies refuse its write of the operator's leader
    Lease and of another node's Lease, and accept its own."""
    rendered = helm.template_text("--show-only", "templates/agent-policies.yaml", release="review")
    kubectl.run("apply", "--server-side", "-f", "-", stdin=rendered)
    sa = f"{chart_rbac}-agent"
    node = f"node-{uuid.uuid4().hex[:6]}"
    try:
        kube.create(Node(metadata=ObjectMeta(name=node)))
        token = pod_bound_token(kube, NAMESPACE, sa, node)
        kubeconfig = yaml.safe_load(kubectl.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": "agent", "user": {"token": token}}]
        kubeconfig["contexts"][0]["context"]["user"] = "agent"
        agent = Client(config=KubeConfig.from_dict(kubeconfig))

        def lease(name: str, holder: str) -> Lease:
            return Lease(
                metadata=ObjectMeta(name=name, namespace=NAMESPACE),
                spec=LeaseSpec(holderIdentity=holder),
            )

        # the policies take effect once loaded: wait for the first refusal
        for _ in range(300):
            try:
                agent.apply(
                    lease("impvm-operator", node), field_manager="x", force=True, dry_run=True
                )
            except ApiError as e:
                assert "writes only the Lease impvm-agent-" in (e.status.message or ""), e.status
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the chart's agent could write the operator's leader Lease")
        with pytest.raises(ApiError, match="writes only the Lease"):
            agent.apply(
                lease("impvm-agent-other-node", "other-node"), field_manager="x", force=True
            )
        agent.apply(lease(f"impvm-agent-{node}", node), field_manager="x", force=True)
        kube.delete(Lease, f"impvm-agent-{node}", namespace=NAMESPACE)
    finally:
        for pod in kube.list(Pod, namespace=NAMESPACE):
            if pod.spec is not None and pod.spec.nodeName == node and pod.metadata is not None:
                kube.delete(Pod, pod.metadata.name or "", namespace=NAMESPACE)
        with contextlib.suppress(ApiError):
            kube.delete(Node, node)
        kubectl.run("delete", "--wait=false", "-f", "-", stdin=rendered)


def _diff(got: set[Any], want: set[Any]) -> dict[str, list[Any]]:
    return {"extra": sorted(got - want), "missing": sorted(want - got)}


def test_rendered_documents_are_all_known_kinds(helm: Helm) -> None:
    kinds = {d["kind"] for d in yaml.safe_load_all(helm.template_text()) if d}
    assert kinds == {
        "ServiceAccount",
        "ConfigMap",  # what VM pods are made with
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "DaemonSet",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
