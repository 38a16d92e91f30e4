"""charts/impvm without a cluster: helm lint, the values schema, what the templates render, and
that the chart carries deploy/'s CRDs and RBAC rules verbatim."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from impvm.api.crd import render_yaml
from impvm.scaling.settings import VMPodSettings
from tests.conftest import REPO

from .conftest import CHART, FULL_VALUES, NODE_POOLS, Helm, by_kind, one

DIGEST_OP = "sha256:" + "a" * 64
DIGEST_AG = "sha256:" + "b" * 64


def test_lint_defaults_and_full_values(helm: Helm) -> None:
    for extra in ([], ["--values", str(FULL_VALUES)]):
        out = helm.run("lint", "--strict", str(CHART), "--namespace", "impvm-system", *extra)
        assert "0 chart(s) failed" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "operator.replicas=0"], "operator/replicas"),
        (["--set", "operator.leaderElection.leaseSeconds=1"], "operator/leaderElection"),
        (["--set", "agent.runtmie=qemu"], "additional properties 'runtmie' not allowed"),
        (["--set", "operator.image.digest=sha256:abc"], "operator/image/digest"),
        (["--set", "agent.image.digest=latest"], "agent/image/digest"),
        (["--set", "agent.capabilities={SYS_ADMIN}"], "agent/capabilities/0"),
        (["--set", "agent.qemu.accelerator=hvf"], "agent/qemu/accelerator"),
        (["--set", "operator.service.type=External"], "operator/service/type"),
        (["--set", "agent.hostPath=relative/dir"], "agent/hostPath"),
        (["--set", "agent.network.subnet=10.0.0.0/8"], "agent/network/subnet"),
        (["--set", "vmPods.milliCPUPerVCPU=0"], "vmPods/milliCPUPerVCPU"),
        (["--set", "vmPods.overheadMiB=-1"], "vmPods/overheadMiB"),
        (["--set", "vmPods.image.digest=latest"], "vmPods/image/digest"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(
    helm: Helm, args: list[str], message: str
) -> None:
    proc = helm.run("template", "impvm", str(CHART), "-n", "impvm-system", *args, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


NAMESPACED = {"Deployment", "DaemonSet", "ServiceAccount", "Service", "Role", "RoleBinding"}


@pytest.mark.parametrize("namespace", ["ci", None])
def test_any_namespace_holds_the_whole_release(helm: Helm, namespace: str | None) -> None:
    """Installed into another namespace (or rendered without a namespace flag: helm's
    "default"), every namespaced object, the leader Lease the operator elects on, the agents'
    Lease namespace, the JIT hand-out's callers, the RBAC subjects and the agents' admission
    policies all follow the release namespace; nothing names impvm-system."""
    flag = ["--namespace", namespace] if namespace else []
    ns = namespace or "default"
    out = helm.run("template", "impvm", str(CHART), *flag).stdout
    assert "impvm-system" not in out
    docs = [d for d in yaml.safe_load_all(out) if d]
    for d in docs:
        if d["kind"] in NAMESPACED:
            assert d["metadata"]["namespace"] == ns, (d["kind"], d["metadata"]["name"])
    (op,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert f"--lease-namespace={ns}" in op["args"]
    assert f"--agent-service-account={ns}/impvm-agent" in op["args"]
    (ag,) = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert f"--lease-namespace={ns}" in ag["args"]
    assert f"--operator-url=http://impvm-operator.{ns}.svc:8080" in ag["args"]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        for b in by_kind(docs, kind):
            for subject in b["subjects"]:
                assert subject["namespace"] == ns, b["metadata"]["name"]
    user = f"request.userInfo.username == 'system:serviceaccount:{ns}:impvm-agent'"
    policies = [
        d
        for d in by_kind(docs, "ValidatingAdmissionPolicy")
        if d["metadata"]["name"].startswith("impvm-agent-")
    ]
    assert policies and all(
        [c["expression"] for c in d["spec"]["matchConditions"]] == [user] for d in policies
    )


def _images(docs: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for kind in ("Deployment", "DaemonSet"):
        for d in by_kind(docs, kind):
            (c,) = d["spec"]["template"]["spec"]["containers"]
            out[c["name"]] = c["image"]
    return out


def test_images_rendered_by_digest_when_values_give_one(helm: Helm) -> None:
    pinned = helm.template(
        "--set",
        f"operator.image.digest={DIGEST_OP}",
        "--set",
        f"agent.image.digest={DIGEST_AG}",
        "--set",
        "agent.image.tag=ignored-when-pinned",
    )
    assert _images(pinned) == {
        "operator": f"registry.example.com/impvm/impvm@{DIGEST_OP}",
        "agent": f"registry.example.com/impvm/impvm-agent@{DIGEST_AG}",
    }
    # without a digest: the tag, which defaults to the chart's appVersion; NOTES warn about it
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _images(helm.template("--set", "agent.image.tag=v9")) == {
        "operator": f"registry.example.com/impvm/impvm:{app_version}",
        "agent": "registry.example.com/impvm/impvm-agent:v9",
    }


def test_operator_deployment(helm: Helm) -> None:
    docs = helm.template()
    dep = one(docs, "Deployment", "impvm-operator")
    spec = dep["spec"]
    # replicas elect a leader, so a rolling update (two at once) is safe
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "RollingUpdate"}
    two = one(helm.template("--set", "operator.replicas=2"), "Deployment", "impvm-operator")
    assert two["spec"]["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "impvm-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # alive and Ready on every replica, standbys included (they forward deliveries)
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert "--advertise-url=http://$(POD_IP):8080" in c["args"]
    assert "--leader-lease-seconds=15" in c["args"]
    (env,) = c["env"]
    assert env["name"] == "POD_IP" and env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["args"][:3] == ["operator", "--http-host=0.0.0.0", "--http-port=8080"]
    svc = one(docs, "Service", "impvm-operator")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert not by_kind(docs, "Ingress") and not by_kind(docs, "ServiceMonitor")


def test_agent_daemonset(helm: Helm) -> None:
    ds = one(helm.template(), "DaemonSet", "impvm-agent")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"imp.dev/agent": "true"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "SYS_ADMIN" not in sc["capabilities"]["add"]
    # what setpriv needs to start each VM's QEMU as a uid of its own
    assert {"SETUID", "SETGID", "SETPCAP"} <= set(sc["capabilities"]["add"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert mounts["dev-kvm"] == "/dev/kvm" and mounts["dev-net-tun"] == "/dev/net/tun"
    assert vols["dev-kvm"]["hostPath"] == {"path": "/dev/kvm", "type": "CharDevice"}
    assert vols["dev-net-tun"]["hostPath"] == {"path": "/dev/net/tun", "type": "CharDevice"}
    assert vols["state"]["hostPath"] == {"path": "/var/lib/impvm", "type": "DirectoryOrCreate"}
    assert mounts["state"] == "/var/lib/impvm"
    assert "--workdir=/var/lib/impvm" in c["args"] and "--runtime=qemu" in c["args"]
    # each VM its own network; forwarding in the pod's namespace as a sysctl
    assert "--guest-network=isolated" in c["args"]
    assert "--guest-subnet=10.213.0.0/16" in c["args"]
    assert pod["securityContext"]["sysctls"] == [{"name": "net.ipv4.ip_forward", "value": "1"}]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c[
        "env"
    ]
    # guests never reach the node's addresses nor get the pod's resolvers (the cluster's DNS):
    # the agent learns the node's addresses and gets the node's own resolv.conf
    assert {"name": "HOST_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIPs"}}} in c[
        "env"
    ]
    assert "--guest-dns-from=/etc/impvm/node-resolv.conf" in c["args"]
    assert mounts["node-resolv-conf"] == "/etc/impvm/node-resolv.conf"
    assert vols["node-resolv-conf"]["hostPath"] == {"path": "/etc/resolv.conf", "type": "File"}
    assert not [a for a in c["args"] if a.startswith(("--guest-dns=", "--pod-cidr", "--no-detect"))]
    assert "limits" not in c["resources"]  # VMs share the container's cgroup

    # a node without KVM: no /dev/kvm mount (QEMU uses TCG); a KVM device plugin's resource
    ds = one(
        helm.template("--set", "agent.kvm=false", "--set", "agent.kvmResource=squat.ai/kvm"),
        "DaemonSet",
    )
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "dev-kvm" not in {v["name"] for v in pod["volumes"]}
    assert "/dev/kvm" not in {m["mountPath"] for m in c["volumeMounts"]}
    assert c["resources"]["limits"] == {"squat.ai/kvm": 1}


def test_node_pools_render_one_agent_daemonset_each_under_one_operator(helm: Helm) -> None:
    """agent.nodePools: one DaemonSet per pool with its own nodeSelector, tolerations and size,
    selectors that never overlap, one ServiceAccount and one operator for all of them."""
    docs = helm.template("--values", str(NODE_POOLS), namespace="ci")
    assert [d["metadata"]["name"] for d in by_kind(docs, "Deployment")] == ["impvm-operator"]
    small, large = (one(docs, "DaemonSet", f"impvm-agent-{p}") for p in ("small", "large"))
    assert len(by_kind(docs, "DaemonSet")) == 2
    for ds, pool in ((small, "small"), (large, "large")):
        labels = ds["spec"]["selector"]["matchLabels"]
        assert labels["imp.dev/node-pool"] == pool
        assert ds["spec"]["template"]["metadata"]["labels"]["imp.dev/node-pool"] == pool
        pod = ds["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"imp.dev/host-size": pool}  # replaced, not merged
        assert pod["serviceAccountName"] == "impvm-agent"
        (c,) = pod["containers"]
        assert "--lease-namespace=ci" in c["args"]
    s_pod, l_pod = (ds["spec"]["template"]["spec"] for ds in (small, large))
    assert "tolerations" not in s_pod
    assert l_pod["tolerations"] == [
        {"key": "imp.dev/vm-host", "operator": "Exists", "effect": "NoSchedule"}
    ]
    (s_c,), (l_c,) = s_pod["containers"], l_pod["containers"]
    assert s_c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert l_c["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}}
    assert "--vcpu=32" in l_c["args"] and "--memory-mib=131072" in l_c["args"]
    assert not [a for a in s_c["args"] if a.startswith(("--vcpu", "--memory-mib"))]


def test_vm_pods_go_to_the_node_pools_and_the_operator_accepts_what_the_chart_writes(
    helm: Helm,
) -> None:
    """vmPods: the operator is given --vm-pods and the file; VM pods go to a node of one of
    the node pools, tolerating every pool's taints; the file is what VMPodSettings accepts;
    vmPods.enabled false leaves the operator its own placement."""
    docs = helm.template("--values", str(NODE_POOLS), namespace="ci")
    cm = one(docs, "ConfigMap", "impvm-vm-pods")
    got = VMPodSettings.model_validate_json(cm["data"]["vm-pods.json"])
    assert got.node_selectors == ({"imp.dev/host-size": "small"}, {"imp.dev/host-size": "large"})
    assert got.tolerations == (
        {"key": "imp.dev/vm-host", "operator": "Exists", "effect": "NoSchedule"},
    )
    assert got.image.startswith("registry.example.com/impvm/impvm-agent")  # the agent's image
    assert got.command == ("sleep", "infinity") and got.overhead_mib == 128
    pod = one(docs, "Deployment", "impvm-operator")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "--vm-pods=/etc/impvm/vm-pods/vm-pods.json" in c["args"]
    assert {"name": "vm-pods", "configMap": {"name": "impvm-vm-pods"}} in pod["volumes"]
    off = helm.template("--set", "vmPods.enabled=false")
    assert not by_kind(off, "ConfigMap")
    (c,) = one(off, "Deployment", "impvm-operator")["spec"]["template"]["spec"]["containers"]
    assert not [a for a in c["args"] if a.startswith("--vm-pods")]


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ([{"nodeSelector": {"a": "b"}}], "agent/nodePools/0"),
        ([{"name": "small"}], "agent/nodePools/0"),
        ([{"name": "Small", "nodeSelector": {"a": "b"}}], "agent/nodePools/0/name"),
        ([{"name": "x", "nodeSelector": {}}], "agent/nodePools/0/nodeSelector"),
        ([{"name": "x", "nodeSelector": {"a": "b"}, "vcpus": 2}], "'vcpus' not allowed"),
        ([{"name": "x", "nodeSelector": {"a": "b"}, "vcpu": 0}], "agent/nodePools/0/vcpu"),
    ],
)
def test_a_values_file_the_schema_rejects_names_the_field(
    helm: Helm, tmp_path: Path, pools: list[dict[str, Any]], message: str
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"agent": {"nodePools": pools}}))
    proc = helm.run("template", "impvm", str(CHART), "--values", str(values), check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_a_node_pool_named_twice_is_refused(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    pool = {"name": "small", "nodeSelector": {"a": "b"}}
    values.write_text(yaml.safe_dump({"agent": {"nodePools": [pool, pool]}}))
    proc = helm.run("template", "impvm", str(CHART), "--values", str(values), check=False)
    assert proc.returncode != 0
    assert 'agent.nodePools: the name "small" is given twice' in proc.stderr, proc.stderr


def test_full_values_render_every_option(helm: Helm) -> None:
    docs = helm.template("--values", str(FULL_VALUES))
    dep = one(docs, "Deployment", "impvm-full-operator")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--namespace=ci" in c["args"] and "--namespace=default" in c["args"]
    assert "--github-api-url=https://github.example.com/api/v3" in c["args"]
    assert c["ports"][0]["containerPort"] == 9443
    ing = one(docs, "Ingress")
    (path,) = ing["spec"]["rules"][0]["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/webhooks/github", "Exact")
    ds = one(docs, "DaemonSet", "impvm-full-agent")
    (a,) = ds["spec"]["template"]["spec"]["containers"]
    assert a["resources"]["limits"] == {"devices.kubevirt.io/kvm": 1}
    assert "--insecure-registry=registry.internal:5000" in a["args"]
    # a private CA where skopeo looks for the registry's CA
    assert {
        "name": "registry-ca-0",
        "mountPath": "/etc/containers/certs.d/registry.internal:5443",
        "readOnly": True,
    } in a["volumeMounts"]
    assert {
        "name": "registry-ca-0",
        "configMap": {"name": "internal-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
    } in ds["spec"]["template"]["spec"]["volumes"]
    assert "--vcpu=32" in a["args"] and "--memory-mib=65536" in a["args"]
    assert "--guest-subnet=10.99.0.0/20" in a["args"]
    assert "--guest-dns=192.0.2.53" in a["args"] and "--guest-dns=192.0.2.54" in a["args"]
    assert not [x for x in a["args"] if x.startswith("--guest-dns-from")]  # resolvers given
    for arg in ("--node-cidr=198.51.100.0/24", "--pod-cidr=10.244.0.0/16",
                "--service-cidr=10.96.0.0/12", "--cluster-dns=10.96.0.10",
                "--no-detect-cluster-networks"):  # fmt: skip
        assert arg in a["args"], arg
    assert "--metrics-address=$(POD_IP):9464" in a["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in a["env"]
    assert "--guest-dns=192.0.2.53" in a["args"] and "--guest-dns=192.0.2.54" in a["args"]
    assert "sysctls" not in ds["spec"]["template"]["spec"]["securityContext"]
    sm = helm.template(
        "--values", str(FULL_VALUES), "--set", "operator.serviceMonitor.enabled=true"
    )
    mon = one(sm, "ServiceMonitor")
    assert mon["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert mon["metadata"]["labels"]["release"] == "prometheus"


def _rules(text: str, kind: str) -> list[Any]:
    (doc,) = [d for d in yaml.safe_load_all(text) if d and d["kind"] == kind]
    return list(doc["rules"])


def test_chart_carries_deploy_manifests_verbatim() -> None:
    """The chart's CRDs and RBAC sources, and the package's RBAC copy, are byte copies of
    deploy/ (scripts/sync-chart.sh), and deploy/crds is what the models render."""
    hint = "out of sync: run scripts/sync-chart.sh"
    crds = (REPO / "deploy" / "crds" / "imp.dev_crds.yaml").read_text()
    assert crds == render_yaml()
    assert (CHART / "crds" / "imp.dev_crds.yaml").read_text() == crds, hint
    for component in ("operator", "agent"):
        source = (REPO / "deploy" / "rbac" / f"{component}.yaml").read_text()
        assert (CHART / "files" / "rbac" / f"{component}.yaml").read_text() == source, hint
        package = REPO / "src" / "impvm" / "up" / "assets" / "rbac" / f"{component}.yaml"
        assert package.read_text() == source, hint
    tenant = (REPO / "deploy" / "rbac" / "tenant.yaml").read_text()
    assert (CHART / "files" / "rbac" / "tenant.yaml").read_text() == tenant, hint
    policies = sorted((REPO / "deploy" / "admission").glob("*.yaml"))
    assert policies
    for copies in (CHART / "files" / "admission", REPO / "src/impvm/up/assets/admission"):
        assert sorted(p.name for p in copies.glob("*.yaml")) == [p.name for p in policies], hint
        for p in policies:
            assert (copies / p.name).read_text() == p.read_text(), hint


def test_rendered_agent_policies_are_deploy_policies_for_the_release(helm: Helm) -> None:
    """The chart's admission policies are deploy/admission/agent.yaml's, with only the release's
    agent user name and object names put in: same rules, same messages."""
    source = [
        d
        for d in yaml.safe_load_all((REPO / "deploy" / "admission" / "agent.yaml").read_text())
        if d
    ]
    for release, prefix in (("impvm", "impvm"), ("review", "review-impvm")):
        docs = helm.template(release=release)
        user = f"system:serviceaccount:impvm-system:{prefix}-agent"
        for want in source:
            name = prefix + want["metadata"]["name"].removeprefix("impvm")
            got = one(docs, want["kind"], name)
            assert got["metadata"]["labels"]["app.kubernetes.io/instance"] == release
            if want["kind"] == "ValidatingAdmissionPolicyBinding":
                assert got["spec"] == {
                    **want["spec"],
                    "policyName": prefix + want["spec"]["policyName"].removeprefix("impvm"),
                }
                continue
            (cond,) = got["spec"]["matchConditions"]
            assert cond["expression"] == f"request.userInfo.username == '{user}'"
            rest = {k: v for k, v in got["spec"].items() if k != "matchConditions"}
            assert rest == {k: v for k, v in want["spec"].items() if k != "matchConditions"}


def test_the_chart_renders_the_admission_policies_of_deploy(helm: Helm) -> None:
    """What the API server enforces is deploy/admission's policies, verbatim, unless the
    admissionPolicies value turns them off."""
    want = [
        d
        for p in sorted((REPO / "deploy" / "admission").glob("*.yaml"))
        if p.name != "agent.yaml"  # rendered for the release (the test above)
        for d in yaml.safe_load_all(p.read_text())
    ]
    docs = helm.template()
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    agent = "impvm-agent-"  # the agent's policies, never turned off
    ours = [d for d in docs if d["kind"] in kinds and not d["metadata"]["name"].startswith(agent)]
    assert ours == want
    off = helm.template("--set", "admissionPolicies.enabled=false")
    kept = [d for d in off if d["kind"] in kinds]
    assert kept and all(d["metadata"]["name"].startswith(agent) for d in kept)


def test_the_chart_renders_the_tenant_roles_of_deploy(helm: Helm) -> None:
    want = list(yaml.safe_load_all((REPO / "deploy" / "rbac" / "tenant.yaml").read_text()))
    names = {d["metadata"]["name"] for d in want}
    got = [d for d in helm.template() if d["metadata"].get("name") in names]
    assert got == want
    off = helm.template("--set", "tenantRoles.enabled=false")
    assert not [d for d in off if d["metadata"].get("name") in names]


def test_rendered_rbac_rules_are_deploy_rbac_rules(helm: Helm) -> None:
    docs = helm.template()
    for component in ("operator", "agent"):
        source = (REPO / "deploy" / "rbac" / f"{component}.yaml").read_text()
        role = one(docs, "ClusterRole", f"impvm-{component}")
        assert role["rules"] == _rules(source, "ClusterRole"), component
        binding = one(docs, "ClusterRoleBinding", f"impvm-{component}")
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": f"impvm-{component}", "namespace": "impvm-system"}
        ]
    leases = one(docs, "Role", "impvm-agent-leases")
    assert leases["metadata"]["namespace"] == "impvm-system"
    assert leases["rules"] == _rules((REPO / "deploy" / "rbac" / "agent.yaml").read_text(), "Role")
    # a chart with a drifted copy would render other rules: the copy is what is rendered
    assert "impvm.rbacRules" in (CHART / "templates" / "operator-rbac.yaml").read_text()


def test_packaged_chart_renders_the_same(helm: Helm, tmp_path: Path) -> None:
    """`helm package` keeps what the templates read (files/rbac, crds): the archive renders
    exactly what the directory does."""
    helm.run("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("impvm-*.tgz")
    from_archive = helm.run(
        "template", "impvm", str(archive), "--namespace", "impvm-system", "--include-crds"
    ).stdout
    assert from_archive == helm.template_text("--include-crds")


def test_grafana_dashboard_configmap(helm: Helm) -> None:
    # off by default (the one ConfigMap is what VM pods are made with)
    assert [c["metadata"]["name"] for c in by_kind(helm.template(), "ConfigMap")] == [
        "impvm-vm-pods"
    ]
    docs = helm.template("--values", str(FULL_VALUES))
    cm = one(docs, "ConfigMap", "impvm-full-grafana-dashboard")
    assert cm["metadata"]["namespace"] == "default"  # another namespace than the release's
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "CI"}
    source = (REPO / "deploy" / "grafana" / "impvm-dashboard.json").read_text()
    assert json.loads(cm["data"]["impvm-dashboard.json"]) == json.loads(source)
