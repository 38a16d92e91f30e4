"""The Helm chart as a cluster organised in VM node pools would install it: a release named
``pools`` in the namespace ``impvm-pools`` (not impvm-system), two node pools of one node each
(``small`` on node-1; ``large`` on node-2, which a taint keeps for pods that tolerate it), each
with its own size, under one operator; two jobs of the minimal example pool run in QEMU VMs on
both pools' nodes.

It shares the session's cluster and images with ``test_chart_e2e.py`` and leaves the cluster as
it found it (release, namespace, node labels and taint removed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from impvm.devstack.cluster import Cluster
from tests.cluster.conftest import ClusterImages
from tests.cluster.test_chart_e2e import (
    APP_ID,
    BASE_PLACEHOLDER,
    EXAMPLE,
    INSTALLATION_ID,
    LAYER_PLACEHOLDER,
    ORG,
    cluster_github,
    helm_binary,
    items,
    no_crash_loop,
    no_template_failing,
)
from tests.conftest import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]

NS, RELEASE, JOBS = "impvm-pools", "pools", 2
#: the pool's own namespace and names: test_chart_e2e.py's example pool may still be deleting
TEAM = "pools-team"
TAINT = "imp.dev/vm-host=large:NoSchedule"
#: each node pool's size: one VM of the example's class (2 vCPU, 2048 MiB) at a time on each
#: node, so two jobs at once run on both
SIZES = {"small": (2, 2560), "large": (3, 4096)}


async def test_release_in_another_namespace_serves_two_node_pools(
    tmp_path: Path, cluster: Cluster, cluster_images: ClusterImages
) -> None:
    standin, key = await cluster_github(cluster)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    helm = str(helm_binary())
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(
        EXAMPLE.replace(BASE_PLACEHOLDER, cluster_images.operator)
        .replace(LAYER_PLACEHOLDER, cluster_images.runner_layer)
        .replace("namespace: default", f"namespace: {TEAM}")
        .replace("runner-class", "pools-class")
        .replace("ci-pool", "pools-pool")
    )
    try:
        cluster.kubectl("label", "--overwrite", "node", "node-1", "imp.dev/host-size=small")
        cluster.kubectl("label", "--overwrite", "node", "node-2", "imp.dev/host-size=large")
        cluster.kubectl("taint", "--overwrite", "node", "node-2", TAINT)
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("create", "namespace", TEAM)
        cluster.kubectl(
            "-n", NS, "create", "configmap", "registry-ca", f"--from-file=ca.crt={cluster.ca}"
        )
        registry, _, op_digest = cluster_images.operator.partition("@")
        agent_repo, _, agent_digest = cluster_images.agent.partition("@")
        toleration = {"key": "imp.dev/vm-host", "operator": "Exists", "effect": "NoSchedule"}
        values = {
            "operator": {
                "image": {"repository": registry, "digest": op_digest},
                "githubApiURL": standin.url,
            },
            # the example class's 2 vCPU on these 2-core nodes: half a core each
            "vmPods": {"milliCPUPerVCPU": 500},
            "agent": {
                "image": {"repository": agent_repo, "digest": agent_digest},
                "registryCAs": [{"registry": cluster.registry, "configMap": "registry-ca"}],
                "nodePools": [
                    {
                        "name": "small",
                        "nodeSelector": {"imp.dev/host-size": "small"},
                        "vcpu": SIZES["small"][0],
                        "memoryMiB": SIZES["small"][1],
                    },
                    {
                        "name": "large",
                        "nodeSelector": {"imp.dev/host-size": "large"},
                        "tolerations": [toleration],
                        "resources": {"requests": {"cpu": "50m", "memory": "300Mi"}},
                        "vcpu": SIZES["large"][0],
                        "memoryMiB": SIZES["large"][1],
                    },
                ],
            },
        }
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        (tmp_path / "app.pem").write_text(key)
        installed = time.monotonic()
        out = await asyncio.to_thread(
            subprocess.run,
            [helm, "install", RELEASE, str(REPO / "charts" / "impvm"), "-n", NS, "--values",
             str(tmp_path / "values.yaml")],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        cluster.kubectl(
            "-n", TEAM, "create", "secret", "generic", "github-runner-app",
            f"--from-literal=github_app_id={APP_ID}",
            f"--from-literal=github_app_installation_id={INSTALLATION_ID}",
            f"--from-file=github_app_private_key={tmp_path / 'app.pem'}",
        )  # fmt: skip
        cluster.kubectl("apply", "-f", str(pool_file))
        ids = [
            standin.queue_job(
                f"{ORG}/app", ["self-hosted", "imp"], name=f"pools-{i}", sleep_seconds=2
            ).id
            for i in range(JOBS)
        ]
        jobs = standin.state.jobs
        vm_nodes: dict[str, str] = {}
        deadline = time.monotonic() + 900
        while not all(jobs[i].status == "completed" for i in ids):
            cluster.check()
            assert time.monotonic() < deadline, (
                [(jobs[i].status, jobs[i].runner_name) for i in ids],
                cluster.kubectl("get", "impvm,pods", "-A", "-o", "wide"),
            )
            await asyncio.to_thread(no_crash_loop, cluster, NS)
            await asyncio.to_thread(no_template_failing, cluster, TEAM, NS)
            for vm in await asyncio.to_thread(items, cluster, "impvm", "-n", TEAM):
                if node := (vm.get("spec") or {}).get("nodeName"):
                    vm_nodes[vm["metadata"]["name"]] = node
            await asyncio.sleep(1)
        print(f"node pools: install to {JOBS} jobs done {time.monotonic() - installed:.0f}s")
        assert [jobs[i].conclusion for i in ids] == ["success"] * JOBS
        runners = [jobs[i].runner_name for i in ids]
        assert {vm_nodes[r] for r in runners if r} == {"node-1", "node-2"}, vm_nodes

        # one operator (it elects on its Lease in the release namespace), one agent per pool
        operators = items(cluster, "deploy", "-n", NS)
        assert [d["metadata"]["name"] for d in operators] == ["pools-impvm-operator"]
        lease = json.loads(
            cluster.kubectl("-n", NS, "get", "lease", "impvm-operator", "-o", "json")
        )
        assert lease["spec"]["holderIdentity"]
        for pool, node in (("small", "node-1"), ("large", "node-2")):
            (pod,) = items(cluster, "pods", "-n", NS, "-l", f"imp.dev/node-pool={pool}")
            assert pod["spec"]["nodeName"] == node, pool
            agent = json.loads(
                cluster.kubectl("-n", NS, "get", "lease", f"impvm-agent-{node}", "-o", "json")
            )
            notes = agent["metadata"]["annotations"]
            vcpu, memory = SIZES[pool]
            assert (notes["imp.dev/vcpu"], notes["imp.dev/memory-mib"]) == (
                str(vcpu),
                str(memory),
            ), pool
        # `impvm status` finds the agents of a release outside impvm-system, and says what the
        # preflight found on these nodes, whose containers may not open /dev/kvm: TCG
        status = await asyncio.to_thread(
            subprocess.run,
            [str(REPO / ".venv" / "bin" / "impvm"), "status", "-o", "json", "-n", TEAM],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        # this release's agents (an earlier release's Leases may stay behind, not live)
        agents = {a["node"]: a for a in json.loads(status.stdout)["agents"] if a["namespace"] == NS}
        assert sorted(agents) == ["node-1", "node-2"]
        for node, (vcpu, _) in zip(("node-1", "node-2"), SIZES.values(), strict=True):
            assert agents[node]["live"] and agents[node]["vcpu"] == vcpu, agents[node]
            assert agents[node]["accelerator"].startswith("tcg"), agents[node]
            # and the preflight's warning says why: /dev/kvm cannot be opened
            assert "/dev/kvm" in (agents[node]["preflight"] or ""), agents[node]
        # and the pool says its VMs run emulated, naming the nodes
        (pool,) = items(cluster, "impvmrunnerpools", "-n", TEAM)
        emulated = {c["type"]: c for c in pool["status"]["conditions"]}["Emulated"]
        assert (emulated["status"], emulated["reason"]) == ("True", "NoKVM"), emulated
        assert "TCG" in emulated["message"], emulated
    finally:
        # the pool and its VMs go while the operator and agents still run (their finalizers);
        # off the event loop, which serves the stand-in
        for args in (
            ["delete", "--ignore-not-found", "--timeout=120s", "-f", str(pool_file)],
            ["-n", TEAM, "delete", "--ignore-not-found", "--timeout=120s", "impvm", "--all"],
        ):
            await asyncio.to_thread(cluster.kubectl, *args, check=False)
        await asyncio.to_thread(
            subprocess.run,
            [helm, "uninstall", RELEASE, "-n", NS],
            env=env,
            capture_output=True,
            timeout=300,
        )
        cluster.kubectl("delete", "namespace", NS, TEAM, "--wait=false", check=False)
        cluster.kubectl("taint", "node", "node-2", f"{TAINT}-", check=False)
        for node in ("node-1", "node-2"):
            cluster.kubectl("label", "node", node, "imp.dev/host-size-", check=False)
        await standin.stop()
