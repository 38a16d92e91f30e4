"""The test cluster behaves as a cluster of separate machines: pods on one node reach pods on the
other through routes, Services through kube-proxy, names through CoreDNS and the API server
through its Service with a projected ServiceAccount token; a node's credentials act for that
node only (Node authorizer + NodeRestriction); nothing a pod sends has a way off this machine;
and a crashed run's leftovers (processes, cgroups, namespaces, mounts) are removed by the next
start."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from impvm.devstack.cluster import Cluster, cgroups, state
from tests.cluster.conftest import IMAGE_PYTHON, ClusterImages

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

CLIENT = """
import json, os, ssl, urllib.request
out = {}
for name, url in (("pod", os.environ["POD_URL"]), ("service", os.environ["SVC_URL"])):
    out[name] = urllib.request.urlopen(url, timeout=20).read().decode().strip()
ctx = ssl.create_default_context(
    cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
req = urllib.request.Request("https://kubernetes.default.svc/version",
                             headers={"Authorization": "Bearer " + token})
out["apiserver"] = json.load(urllib.request.urlopen(req, context=ctx, timeout=20))["gitVersion"]
print(json.dumps(out))
"""


def pod(name: str, node: str, image: str, command: list[str], **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "main", "image": image, "command": command, **extra}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": spec,
    }


async def wait_for(what: str, check: Any, cluster: Cluster, seconds: float = 300) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cluster.check()
        got = await asyncio.to_thread(check)
        if got:
            return got
        await asyncio.sleep(1)
    raise AssertionError(f"{what} did not happen within {seconds}s")


async def test_pods_reach_pods_services_dns_and_the_api_server_across_nodes(
    cluster: Cluster, cluster_images: ClusterImages
) -> None:
    ns = "net-check"
    cluster.kubectl("create", "namespace", ns)
    try:
        web = pod(
            "web",
            "node-2",
            cluster_images.operator,
            [
                IMAGE_PYTHON,
                "-c",
                "import http.server as h\n"
                "class H(h.BaseHTTPRequestHandler):\n"
                "  def do_GET(s):\n"
                "    s.send_response(200); s.end_headers(); s.wfile.write(b'hello from node-2')\n"
                "h.HTTPServer(('', 8080), H).serve_forever()",
            ],
            ports=[{"containerPort": 8080}],
            readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
        )
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all([web, svc]))

        def web_ip() -> str:
            got = json.loads(cluster.kubectl("-n", ns, "get", "pod", "web", "-o", "json"))
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in got.get("status", {}).get("conditions", [])
            )
            return str(got["status"].get("podIP", "")) if ready else ""

        ip = await wait_for("the web pod on node-2 Ready", web_ip, cluster)
        client = pod(
            "client",
            "node-1",
            cluster_images.operator,
            [IMAGE_PYTHON, "-c", CLIENT],
            env=[
                {"name": "POD_URL", "value": f"http://{ip}:8080/"},
                {"name": "SVC_URL", "value": f"http://web.{ns}.svc.cluster.local/"},
            ],
        )
        client["spec"]["restartPolicy"] = "Never"
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump(client))

        def done() -> str:
            got = json.loads(cluster.kubectl("-n", ns, "get", "pod", "client", "-o", "json"))
            return str(got.get("status", {}).get("phase", "")) in ("Succeeded", "Failed") and str(
                got["status"]["phase"]
            )

        phase = await wait_for("the client pod on node-1 to finish", done, cluster)
        logs = cluster.kubectl("-n", ns, "logs", "client")
        assert phase == "Succeeded", logs
        out = json.loads(logs.strip().splitlines()[-1])
        assert out["pod"] == out["service"] == "hello from node-2"
        assert out["apiserver"] == "v1.34.4"
        nodes = json.loads(cluster.kubectl("-n", ns, "get", "pods", "-o", "json"))["items"]
        assert {p["metadata"]["name"]: p["spec"]["nodeName"] for p in nodes} == {
            "web": "node-2",
            "client": "node-1",
        }
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_node_acts_only_for_itself(cluster: Cluster) -> None:
    """node-1's kubelet credentials: its own Node yes, node-2's Node no (Node authorizer and
    NodeRestriction, as kubeadm clusters run)."""
    assert cluster.control_plane is not None
    kubeconfig = cluster.workdir / "node-1" / "kubelet.kubeconfig"

    def as_node(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(cluster.kubectl_path), "--kubeconfig", str(kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    own = as_node("label", "node", "node-1", "example.test/mine=yes", "--overwrite")
    assert own.returncode == 0, own.stderr
    other = as_node("label", "node", "node-2", "example.test/mine=yes", "--overwrite")
    assert other.returncode != 0 and "forbidden" in other.stderr.lower(), other.stderr
    restricted = as_node("label", "node", "node-1", "node-restriction.kubernetes.io/x=y")
    assert restricted.returncode != 0 and "forbidden" in restricted.stderr.lower()
    secret = as_node("-n", "kube-system", "get", "secrets")
    assert secret.returncode != 0 and "forbidden" in secret.stderr.lower()
    cluster.kubectl("label", "node", "node-1", "example.test/mine-")


def test_nothing_a_pod_sends_has_a_way_off_this_machine(cluster: Cluster) -> None:
    """Routing only (no packet is sent): the nodes' gateway is the router, and the router knows
    the node network and the stand-in internet and nothing else."""
    net = cluster.network
    assert net is not None

    def route(ns: str, dst: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "-n", ns, "route", "get", dst], capture_output=True, text=True, timeout=30
        )

    for node in net.nodes:
        got = route(node.netns, "192.0.2.1")
        assert got.returncode == 0 and f"via {net.router_address}" in got.stdout, got
    inside = route(net.router_ns, net.internet_address)
    assert inside.returncode == 0, inside.stderr
    for dst in ("192.0.2.1", "10.1.2.3", "169.254.169.254"):
        out = route(net.router_ns, dst)
        assert out.returncode != 0 and "unreachable" in out.stderr.lower(), (dst, out)


def _leftovers(record: state.ClusterRecord) -> dict[str, Any]:
    netns = set(os.listdir("/run/netns")) if Path("/run/netns").is_dir() else set()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {
        "processes": sorted(cgroups.pids(record.cgroup)),
        "cgroups": [
            str(h / record.cgroup) for h in cgroups.hierarchies() if (h / record.cgroup).exists()
        ],
        "netns": sorted(netns & set(record.netns)),
        "links": [link for link in record.links if f" {link}:" in links or f" {link}@" in links],
        "mounts": state.mounts_under(Path(record.workdir)) if Path(record.workdir).exists() else [],
    }


def test_a_crashed_run_is_cleaned_up_by_the_next_start() -> None:
    """A cluster whose owner is SIGKILLed leaves kubelet, containerd, pods, cgroups, namespaces
    and mounts behind; the next start (``state.remove_stale``, which :meth:`Cluster.start`
    calls first) removes all of it."""
    # a short base: the nodes' files keep paths that tools such as umoci handle
    base = Path(tempfile.mkdtemp(prefix="icl-", dir="/tmp"))
    name = "crashed"
    proc = _serve(base, name)
    _ready(base, name, proc)
    record = state.ClusterRecord.load(base / name / state.RECORD)
    assert record is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _leftovers(record)
    assert left["processes"] and left["cgroups"] and left["netns"] and left["links"], left
    assert left["mounts"], left

    assert state.remove_stale(base) == [name]
    assert _leftovers(record) == {
        "processes": [],
        "cgroups": [],
        "netns": [],
        "links": [],
        "mounts": [],
    }
    assert not (base / name).exists()
    shutil.rmtree(base, ignore_errors=True)


def _serve(base: Path, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "impvm.devstack.cluster",
            "serve",
            "--name",
            name,
            "--nodes",
            "1",
            "--base",
            str(base),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _ready(base: Path, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    ready = base / name / "ready.json"
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None, "the cluster did not start"
        assert time.monotonic() < deadline, "the cluster did not start in time"
        time.sleep(0.5)
    info: dict[str, Any] = json.loads(ready.read_text())
    return info


def test_a_second_start_of_a_name_replaces_the_running_cluster() -> None:
    """The first owner is stopped before its cluster is removed (else it would tear down, as it
    exits, what was started in its place); SIGTERM stops the second and removes everything."""
    base = Path(tempfile.mkdtemp(prefix="icl-", dir="/tmp"))
    first = _serve(base, "again")
    try:
        _ready(base, "again", first)
        (base / "again" / "ready.json").unlink()
        second = _serve(base, "again")
        info = _ready(base, "again", second)
        assert first.wait(timeout=60) == 0
        nodes = subprocess.run(
            [info["kubectl"], "--kubeconfig", info["kubeconfig"], "get", "nodes", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        (node,) = json.loads(nodes.stdout)["items"]
        assert any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"]
        )
        assert second.poll() is None  # the first's exit removed nothing of it
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 0
        assert not (base / "again").exists()
    finally:
        for p in (first, locals().get("second")):
            if isinstance(p, subprocess.Popen) and p.poll() is None:
                p.kill()
        state.remove_stale(base)
        shutil.rmtree(base, ignore_errors=True)
