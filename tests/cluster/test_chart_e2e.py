"""The Helm chart on the real two-node cluster, installed with README.md's "Run on your cluster"
commands: two operator replicas, an agent pod per node, the minimal example pool, and three jobs
run by the GitHub stand-in's runner in QEMU VMs (TCG where /dev/kvm is not usable) inside the
agent pods of both nodes, each placed by kube-scheduler through its VM pod; the leading operator
pod is deleted in the middle of the burst, the other replica takes over, and no job is lost nor
any JIT config minted twice.

What differs from a real install, and why: GitHub is the stand-in, serving in the cluster's
"internet" namespace behind its router (pods reach it by NAT, as they would reach GitHub), seeded
with the App and installation ids the test gives the README's variables; the images are the ones
``impvm images build`` makes, in the cluster's registry, whose certificate the cluster's CA signs,
so ``helm install`` gets one more values file (the stand-in's URL, two operator replicas and that
CA through ``agent.registryCAs``, as the README says for a private CA), added by a ``helm`` wrapper
on PATH; ``pool.yaml`` is the minimal example (tests/data/minimal-example.yaml) with the
``impvm`` image as the VM's base (the stand-in runner needs its Python) and the stand-in runner
layer, both by digest.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from impvm.devstack.cluster import Cluster
from impvm.devstack.seed import make_private_key, seed_github
from impvm.devstack.standin import StandIn
from tests.chart import test_readme as readme
from tests.cluster.conftest import ClusterImages
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

EXAMPLE = (REPO / "tests" / "data" / "minimal-example.yaml").read_text()
BASE_PLACEHOLDER = "registry.example/imp/runner-base@sha256:1111111111111111111111111111111111111111111111111111111111111111"
LAYER_PLACEHOLDER = "registry.example/imp/runner-layer@sha256:2222222222222222222222222222222222222222222222222222222222222222"
APP_ID, INSTALLATION_ID, ORG = 4242, 777, "my-org"
JOBS = 3


def helm_binary() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-helm.sh")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def tools(tmp_path: Path, cluster: Cluster, values: Path) -> Path:
    """A PATH directory with kubectl and a helm that adds ``values`` to ``helm install``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "kubectl").symlink_to(cluster.kubectl_path)
    wrapper = bindir / "helm"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = install ]; then exec {helm_binary()} "$@" --values {values}; fi\n'
        f'exec {helm_binary()} "$@"\n'
    )
    wrapper.chmod(0o755)
    return bindir


def no_crash_loop(cluster: Cluster, namespace: str = "impvm-system") -> None:
    """Fail at once, with its last log, when a chart pod's container in ``namespace`` keeps
    restarting (the chart or an image is broken: waiting would only time out)."""
    for p in items(cluster, "pods", "-n", namespace):
        for c in p.get("status", {}).get("containerStatuses", []):
            if c.get("restartCount", 0) >= 3:
                name = p["metadata"]["name"]
                log = cluster.kubectl("-n", namespace, "logs", name, "--previous", check=False)
                raise AssertionError(f"{name} restarts: {c.get('state')}\n{log[-3000:]}")


async def cluster_github(cluster: Cluster) -> tuple[StandIn, str]:
    """The stand-in GitHub, started where the cluster's pods reach it as they would the
    internet, seeded with the App and its installation; and the App's private key (PEM)."""
    net = cluster.network
    assert net is not None
    standin = StandIn(sock=cluster.internet.socket(net.internet_address, 0))
    await standin.start()
    key = make_private_key()
    seed_github(standin, key, app_id=APP_ID, installation_id=INSTALLATION_ID, org=ORG)
    return standin, key


def leader_identity(cluster: Cluster) -> str:
    """The holder of the operator's leader Lease ("<pod name>-<random>"; empty: none)."""
    lease = json.loads(
        cluster.kubectl("-n", "impvm-system", "get", "lease", "impvm-operator", "-o", "json")
    )
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def vm_pod_list(cluster: Cluster) -> list[dict[str, Any]]:
    return items(cluster, "pods", "-n", "impvm-system", "-l", "app.kubernetes.io/component=vm")


async def wait_for(what: str, check: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(1)


async def a_vm_that_fits_nowhere_leaves_a_pending_pod(cluster: Cluster) -> None:
    """An ImpVM of a class bigger than any node: its VM pod stays Pending with the scheduler's
    reason (what a cluster autoscaler acts on), its owners see that reason as an Event, and the
    VM is bound nowhere."""
    docs = [
        {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVMClass",
            "metadata": {"name": "too-big"},
            "spec": {"vcpu": 64, "memoryMiB": 4096, "diskGiB": 1},
        },
        {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVM",
            "metadata": {"name": "too-big", "namespace": "default"},
            "spec": {
                "classRef": {"name": "too-big"},
                "image": "registry.example/none@sha256:" + "3" * 64,
            },
        },
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    try:

        def pending() -> bool:
            for p in vm_pod_list(cluster):
                if p["metadata"]["annotations"]["imp.dev/vm"] != "default/too-big":
                    continue
                for c in p.get("status", {}).get("conditions", []):
                    if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                        return "Insufficient cpu" in c.get("message", "")
            return False

        await wait_for("a Pending VM pod: Insufficient cpu", pending)

        def told() -> bool:
            return any(
                e["reason"] == "FailedScheduling" and "Insufficient cpu" in e.get("message", "")
                for e in items(
                    cluster, "events", "-n", "default",
                    "--field-selector", "involvedObject.name=too-big",
                )
            )  # fmt: skip

        await wait_for("FailedScheduling on the ImpVM", told)
        vm = json.loads(cluster.kubectl("-n", "default", "get", "impvm", "too-big", "-o", "json"))
        assert not vm["spec"].get("nodeName")
    finally:
        cluster.kubectl("-n", "default", "delete", "impvm", "too-big", "--wait=false", check=False)
        cluster.kubectl("delete", "impvmclass", "too-big", "--wait=false", check=False)


def uninstall(env: dict[str, str]) -> None:
    subprocess.run(
        [str(helm_binary()), "uninstall", "impvm", "--namespace", "impvm-system"],
        env=env,
        capture_output=True,
        timeout=300,
    )


def items(cluster: Cluster, *args: str) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = json.loads(cluster.kubectl("get", *args, "-o", "json"))["items"]
    return got


def no_template_failing(cluster: Cluster, namespace: str, agents: str) -> None:
    """Fail now, with the agents' last words, when a pool in ``namespace`` says its VMs fail at
    start (TemplateFailing): the jobs would wait out the deadline for nothing."""
    for pool in items(cluster, "impvmrunnerpools", "-n", namespace):
        for c in (pool.get("status") or {}).get("conditions", []):
            if c["type"] == "TemplateFailing" and c["status"] == "True":
                logs = cluster.kubectl(
                    "-n", agents, "logs", "-l", "app.kubernetes.io/component=agent",
                    "--tail=40", "--prefix", check=False,
                )  # fmt: skip
                raise AssertionError(f"{pool['metadata']['name']}: {c['message']}\n{logs}")


async def test_readme_install_runs_jobs_in_vms_on_both_nodes(
    tmp_path: Path, cluster: Cluster, cluster_images: ClusterImages
) -> None:
    standin, key = await cluster_github(cluster)
    (tmp_path / "app.pem").write_text(key)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    try:
        # the registry's CA for the agents, then the README's commands
        cluster.kubectl("create", "namespace", "impvm-system")
        cluster.kubectl(
            "-n",
            "impvm-system",
            "create",
            "configmap",
            "impvm-registry-ca",
            f"--from-file=ca.crt={cluster.ca}",
        )
        values = tmp_path / "cluster-values.yaml"
        values.write_text(
            yaml.safe_dump(
                {
                    "operator": {"replicas": 2, "githubApiURL": standin.url},
                    # the example class's 2 vCPU on these 2-core nodes: half a core each
                    "vmPods": {"milliCPUPerVCPU": 500},
                    "agent": {
                        "registryCAs": [
                            {"registry": cluster.registry, "configMap": "impvm-registry-ca"}
                        ]
                    },
                }
            )
        )
        env["PATH"] = f"{tools(tmp_path, cluster, values)}:{env['PATH']}"
        (tmp_path / "charts").symlink_to(REPO / "charts")
        (tmp_path / "pool.yaml").write_text(
            EXAMPLE.replace(BASE_PLACEHOLDER, cluster_images.operator).replace(
                LAYER_PLACEHOLDER, cluster_images.runner_layer
            )
        )
        text = readme.section("Run on your cluster")
        sh = [b for lang, b in readme.blocks(text) if lang == "sh"]
        assert len(sh) == 3
        registry, _, operator_digest = cluster_images.operator.partition("@")
        script = "\n".join(
            [
                readme.override(
                    sh[0],
                    {
                        "OPERATOR_DIGEST": operator_digest,
                        "AGENT_DIGEST": cluster_images.agent.partition("@")[2],
                        "REGISTRY": registry.rsplit("/", 1)[0],
                        "NODES": '"node-1 node-2"',
                        "APP_ID": str(APP_ID),
                        "INSTALLATION_ID": str(INSTALLATION_ID),
                        "PRIVATE_KEY": str(tmp_path / "app.pem"),
                        "WEBHOOK_SECRET": "unused-by-a-polling-pool",
                    },
                ),
                *sh[1:],
            ]
        )
        installed = time.monotonic()
        out = await asyncio.to_thread(readme.bash, script, tmp_path, env)
        assert "ci-pool" in out
        ids = [
            standin.queue_job(
                f"{ORG}/app", ["self-hosted", "imp"], name=f"job-{i}", sleep_seconds=2
            ).id
            for i in range(JOBS)
        ]
        jobs = standin.state.jobs
        vm_nodes: dict[str, str] = {}
        pod_nodes: dict[str, str] = {}  # "default/<vm>" -> the node kube-scheduler chose
        # the leading operator pod is deleted once the burst's first VM is bound
        deleted: tuple[str, float] | None = None
        takeover: float | None = None
        first_done: float | None = None
        deadline = time.monotonic() + 1200
        while not all(jobs[i].status == "completed" for i in ids):
            cluster.check()
            assert time.monotonic() < deadline, (
                [(jobs[i].status, jobs[i].runner_name) for i in ids],
                cluster.kubectl("get", "impvm,pods", "-A", "-o", "wide"),
            )
            await asyncio.to_thread(no_crash_loop, cluster)
            await asyncio.to_thread(no_template_failing, cluster, "default", "impvm-system")
            for lease in await asyncio.to_thread(
                items,
                cluster,
                "lease",
                "-n",
                "impvm-system",
                "-l",
                "app.kubernetes.io/name=impvm-agent",
            ):
                preflight = lease["metadata"].get("annotations", {}).get("imp.dev/preflight", "")
                assert not preflight.startswith("failed"), (lease["metadata"]["name"], preflight)
            for vm in await asyncio.to_thread(items, cluster, "impvm", "-n", "default"):
                if node := (vm.get("spec") or {}).get("nodeName"):
                    vm_nodes[vm["metadata"]["name"]] = node
            for p in await asyncio.to_thread(vm_pod_list, cluster):
                if node := p["spec"].get("nodeName"):
                    pod_nodes[p["metadata"]["annotations"]["imp.dev/vm"]] = node
            if deleted is None and vm_nodes:
                leader = (await asyncio.to_thread(leader_identity, cluster)).rsplit("-", 1)[0]
                await asyncio.to_thread(
                    cluster.kubectl, "-n", "impvm-system", "delete", "pod", leader, "--wait=false"
                )
                deleted = (leader, time.monotonic())
            elif deleted is not None and takeover is None:
                holder = await asyncio.to_thread(leader_identity, cluster)
                if holder and not holder.startswith(deleted[0] + "-"):
                    takeover = time.monotonic() - deleted[1]
            if first_done is None and any(jobs[i].status == "completed" for i in ids):
                first_done = time.monotonic() - installed
            await asyncio.sleep(1)
        total = time.monotonic() - installed
        print(f"chart: install to first job done {first_done:.0f}s, to {JOBS} jobs {total:.0f}s")
        assert deleted is not None and takeover is not None, "no other replica took the lead"
        print(f"chart: leader pod deleted mid-burst, another replica leading after {takeover:.1f}s")

        assert [jobs[i].conclusion for i in ids] == ["success"] * JOBS
        runners = [jobs[i].runner_name for i in ids]
        assert len(set(runners)) == JOBS
        assert {vm_nodes[r] for r in runners if r} == {"node-1", "node-2"}, vm_nodes
        # each VM ran where kube-scheduler put its VM pod, and its pod went with it
        for vm_name, node in vm_nodes.items():
            assert pod_nodes.get(f"default/{vm_name}") == node, (vm_name, pod_nodes)
        await wait_for(
            "the finished VMs' pods deleted",
            lambda: (
                not {p["metadata"]["annotations"]["imp.dev/vm"] for p in vm_pod_list(cluster)}
                & {f"default/{r}" for r in runners}
            ),
        )
        scheduled_by = {
            e["source"].get("component") or e.get("reportingComponent")
            for e in items(cluster, "events", "-n", "impvm-system")
            if e["reason"] == "Scheduled" and e["involvedObject"]["name"].startswith("vm-")
        }
        assert scheduled_by == {"default-scheduler"}, scheduled_by
        await a_vm_that_fits_nowhere_leaves_a_pending_pod(cluster)
        # one JIT config per VM, though two operator replicas ran
        mints = [
            r.get("runner_name")
            for r in standin.state.requests
            if r["path"].endswith("/generate-jitconfig")
        ]
        assert sorted(set(mints)) == sorted(mints) and set(runners) <= set(mints)

        # the Deployment replaced the deleted replica
        def two_operators() -> bool:
            got = items(
                cluster, "pods", "-n", "impvm-system", "-l", "app.kubernetes.io/component=operator"
            )
            names = [
                p["metadata"]["name"] for p in got if not p["metadata"].get("deletionTimestamp")
            ]
            return len(names) == 2 and deleted is not None and deleted[0] not in names

        await wait_for("two operator replicas again", two_operators)
        operators = [
            p
            for p in items(
                cluster, "pods", "-n", "impvm-system", "-l", "app.kubernetes.io/component=operator"
            )
            if not p["metadata"].get("deletionTimestamp")
        ]
        assert leader_identity(cluster)
        # each node's agent ran VMs under QEMU, in its pod; no runner secret in any pod's log
        agents = items(
            cluster, "pods", "-n", "impvm-system", "-l", "app.kubernetes.io/component=agent"
        )
        assert sorted(p["spec"]["nodeName"] for p in agents) == ["node-1", "node-2"]
        secrets = [r.session_token for r in standin.state.runners.values()]
        for p in agents + operators:
            log = cluster.kubectl("-n", "impvm-system", "logs", p["metadata"]["name"])
            assert not any(s in log for s in secrets), p["metadata"]["name"]
            if p in agents:
                assert "runtime qemu started the VM" in log, p["metadata"]["name"]
    finally:
        for cmd in (
            ["delete", "--ignore-not-found", "--wait=false", "-f", str(tmp_path / "pool.yaml")],
            [
                "-n",
                "default",
                "delete",
                "--ignore-not-found",
                "secret",
                "github-runner-app",
                "github-webhook",
            ],
        ):
            cluster.kubectl(*cmd, check=False)
        await asyncio.to_thread(uninstall, env)
        cluster.kubectl("delete", "namespace", "impvm-system", "--wait=false", check=False)
        await standin.stop()
