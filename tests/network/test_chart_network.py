"""Guests of an agent in a pod, as the chart runs it, reach neither the node nor the cluster.

The world models a chart node with network namespaces this test makes:

* "node": a public-looking address (a documentation range, outside every blocked range) on its
  uplink to the test "internet", with kubelet (10250), sshd (22) and a NodePort (30080)
  listening on every node address; the
  cluster's service network behind it (the ``kubernetes`` Service at 10.96.0.1:443, the cluster
  DNS at 10.96.0.10 answering ``kubernetes.default.svc.cluster.local``) and another pod
  (10.244.2.7:80). It forwards and masquerades its pods' traffic, as a node does.
* "agent pod": its own address (10.244.1.5) behind the node, a listener on it, and the
  ClusterFirst resolv.conf a pod gets (nameserver 10.96.0.10). The agent's network side runs
  here (tests/network/chart_harness.py), with the chart's arguments: the downward API's
  ``HOST_IPS``, the chart's pod and service CIDR values, the node's own resolv.conf naming the
  upstream resolver in the internet.

The guests (probe VMs: process sandboxes, and QEMU guests) run under a class that opens the
internal network ``10.0.0.0/8`` - what an admin does for an internal registry - and still reach
none of the node's or the cluster's addresses and are never given the cluster's DNS; a class
that names two of them explicitly reaches exactly those. The internet stays reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from impvm.agent.network.policy import Allow, EgressLayer, PortRange
from impvm.agent.qemu import QemuRuntime
from impvm.devstack.netns import (
    GUEST_RANGES,
    INTERNET_RANGES,
    NetNamespace,
    pick_subnet,
    run_token,
)
from impvm.devstack.registry import LocalRegistry
from tests.conftest import REPO

from .conftest import World, _serve

POD_CIDR, SERVICE_CIDR = "10.244.0.0/16", "10.96.0.0/12"
KUBERNETES, CLUSTER_DNS, POD_B = "10.96.0.1", "10.96.0.10", "10.244.2.7"
NODE_GW, AGENT_POD = "10.244.1.1", "10.244.1.5"  # the node's end of the pod's link, the pod
#: the class of the "wide" guests: the public internet plus the internal 10/8 network
WIDE = EgressLayer("class", allow=(Allow("10.0.0.0/8"),))


@dataclass
class ChartWorld:
    token: str
    node: NetNamespace
    pod: NetNamespace
    node_address: str  # the node's public-looking address
    node_resolv_conf: Path  # the node's own resolv.conf (the chart mounts it)
    registry: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _in(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *args], check=True, capture_output=True, timeout=30)


def _make(world: World, t: str, node_resolv: Path) -> tuple[NetNamespace, NetNamespace, str]:
    """The node and agent pod namespaces, their links and addresses (see the module
    docstring); returns (node, pod, the node's public address)."""
    # public-looking: from the documentation ranges the test internet uses, not one of its own
    uplink = ipaddress.IPv4Network(pick_subnet(INTERNET_RANGES, 29))
    inet_end, node_addr = str(uplink.network_address + 1), str(uplink.network_address + 2)
    node = NetNamespace(f"impvm-node-{t}", f"ivx{t}", str(uplink), node_addr, [node_addr])
    pod = NetNamespace(f"impvm-pod-{t}", f"ivy{t}", POD_CIDR, NODE_GW, [AGENT_POD])
    for ns in (node, pod):
        _ip("netns", "add", ns.name)
        ns.created = True
    # node <-> internet: the node's public address on its uplink
    _ip("link", "add", f"ivu{t}", "netns", node.name, "type", "veth",
        "peer", "name", f"ivw{t}", "netns", world.internet.name)  # fmt: skip
    _in(node.name, "ip", "addr", "add", f"{node_addr}/29", "dev", f"ivu{t}")
    _in(world.internet.name, "ip", "addr", "add", f"{inet_end}/29", "dev", f"ivw{t}")
    for ns_name, dev in ((node.name, f"ivu{t}"), (world.internet.name, f"ivw{t}")):
        _in(ns_name, "ip", "link", "set", "dev", dev, "up")
    _in(node.name, "ip", "route", "add", "default", "via", inet_end)
    # node <-> agent pod
    _ip("link", "add", f"ivv{t}", "netns", node.name, "type", "veth",
        "peer", "name", "eth0", "netns", pod.name)  # fmt: skip
    _in(node.name, "ip", "addr", "add", f"{NODE_GW}/24", "dev", f"ivv{t}")
    _in(node.name, "ip", "link", "set", "dev", f"ivv{t}", "up")
    _in(pod.name, "ip", "addr", "add", f"{AGENT_POD}/24", "dev", "eth0")
    for ns_name in (node.name, pod.name):
        _in(ns_name, "ip", "link", "set", "dev", "lo", "up")
    _in(pod.name, "ip", "link", "set", "dev", "eth0", "up")
    _in(pod.name, "ip", "route", "add", "default", "via", NODE_GW)
    # the cluster behind the node: services, the cluster DNS, another pod
    for a in (KUBERNETES, CLUSTER_DNS, POD_B):  # local to the node, as kube-proxy makes them
        _in(node.name, "ip", "addr", "add", f"{a}/32", "dev", "lo")
    # a node forwards its pods' traffic and masquerades what leaves by its uplink
    _in(node.name, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    nat = (f"table ip node{t} {{\n chain post {{\n  type nat hook postrouting priority srcnat;\n"
           f'  oifname "ivu{t}" masquerade\n }}\n}}\n')  # fmt: skip
    subprocess.run(["ip", "netns", "exec", node.name, "nft", "-f", "-"], input=nat,
                   text=True, check=True, timeout=30)  # fmt: skip
    # what a pod with dnsPolicy ClusterFirst has (ip netns exec shows it as /etc/resolv.conf),
    # and what the node itself uses
    etc = Path("/etc/netns") / pod.name
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text(
        "search impvm-system.svc.cluster.local svc.cluster.local cluster.local\n"
        f"nameserver {CLUSTER_DNS}\noptions ndots:5\n"
    )
    node_resolv.write_text(f"nameserver {world.dns}\n")
    return node, pod, node_addr


def _remove(world: World, t: str, node: NetNamespace, pod: NetNamespace) -> None:
    shutil.rmtree(Path("/etc/netns") / pod.name, ignore_errors=True)
    with contextlib.suppress(subprocess.CalledProcessError):
        _in(world.internet.name, "ip", "link", "del", f"ivw{t}")
    for ns in (pod, node):
        ns.delete()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def chart_world(
    world: World, registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ChartWorld]:
    t = world.token + run_token()[:2]
    node_resolv = tmp_path_factory.mktemp("node-etc") / "resolv.conf"
    runners: list[web.AppRunner] = []
    procs: list[asyncio.subprocess.Process] = []
    node = NetNamespace(f"impvm-node-{t}", f"ivx{t}", "0.0.0.0/32", "0.0.0.0", [])
    pod = NetNamespace(f"impvm-pod-{t}", f"ivy{t}", POD_CIDR, NODE_GW, [AGENT_POD])
    try:
        node, pod, node_addr = await asyncio.to_thread(_make, world, t, node_resolv)
        for port, body in ((10250, "kubelet"), (22, "sshd"), (30080, "nodeport")):
            await _serve(runners, body, node.socket("0.0.0.0", port))
        await _serve(runners, "kubernetes", node.socket(KUBERNETES, 443))
        await _serve(runners, "pod-b", node.socket(POD_B, 80))
        await _serve(runners, "agent-metrics", pod.socket("0.0.0.0", 9464))
        procs.append(
            await asyncio.create_subprocess_exec(
                *node.exec_args(
                    "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                    "--no-hosts", "--bind-interfaces", f"--listen-address={CLUSTER_DNS}",
                    "--user=root", "--pid-file=",
                    f"--address=/kubernetes.default.svc.cluster.local/{KUBERNETES}",
                    f"--address=/github.test/{world.a}",
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        yield ChartWorld(t, node, pod, node_addr, node_resolv, registry.address)
    finally:
        for p in procs:
            p.terminate()
            await p.wait()
        for r in runners:
            await r.cleanup()
        await asyncio.to_thread(_remove, world, t, node, pod)


def _skopeo_wrapper(bin_dir: Path) -> None:
    """``skopeo`` for the harness: the agent pod pulls from the test's loopback registry by
    running skopeo in the test's own network namespace."""
    bin_dir.mkdir()
    skopeo = bin_dir / "skopeo"
    real = shutil.which("skopeo")
    skopeo.write_text(f'#!/bin/sh\nexec nsenter --net=/proc/{os.getpid()}/ns/net -- {real} "$@"\n')
    skopeo.chmod(0o755)


@contextlib.asynccontextmanager
async def harness(
    cw: ChartWorld, world: World, tmp_path: Path, runtime: str, vms: list[dict[str, object]],
    qemu: Path | None = None,
) -> AsyncIterator[dict[str, list[str]]]:  # fmt: skip
    """The agent's network side in the agent pod (see chart_harness.py), running ``vms``."""
    wrappers = tmp_path / "bin"
    await asyncio.to_thread(_skopeo_wrapper, wrappers)
    subnet = pick_subnet(GUEST_RANGES, 24, avoid=(world.config.subnet,))
    config = {
        "workdir": str(tmp_path / "agent"),
        "subnet": subnet,
        "table": f"ivc{cw.token}",
        "prefix": f"ic{cw.token}",
        "pod_cidrs": [POD_CIDR],  # agent.network.cluster.podCIDRs
        "service_cidrs": [SERVICE_CIDR],  # agent.network.cluster.serviceCIDRs
        "node_resolv_conf": str(cw.node_resolv_conf),
        "store": str(tmp_path / "cache"),
        "insecure": [cw.registry],
        "runtime": runtime,
        "qemu": str(qemu) if qemu else None,
        "vms": vms,
    }
    await asyncio.to_thread((tmp_path / "harness.json").write_text, json.dumps(config))
    log = await asyncio.to_thread((tmp_path / "harness.log").open, "wb")
    env = {
        **os.environ,
        "PATH": f"{wrappers}:{os.environ['PATH']}",
        # what the kubelet and the chart's downward API give the agent's container
        "KUBERNETES_SERVICE_HOST": KUBERNETES,
        "KUBERNETES_SERVICE_PORT": "443",
        "HOST_IPS": cw.node_address,
        "PYTHONPATH": str(REPO),
    }
    proc = await asyncio.create_subprocess_exec(
        *cw.pod.exec_args(sys.executable, "-m", "tests.network.chart_harness",
                          str(tmp_path / "harness.json")),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        env=env,
        cwd=str(REPO),
    )  # fmt: skip
    log.close()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 600)
        if not line:
            raise AssertionError((tmp_path / "harness.log").read_text()[-4000:])
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 120)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, (tmp_path / "harness.log").read_text()[-4000:]


def _vm(
    name: str, images: tuple[str, str], world: World, layers: tuple[EgressLayer, ...]
) -> dict[str, object]:
    return {
        "name": name,
        "image": images[0],
        "layer": images[1],
        "jit": world.control.jit(name),
        "layers": [x.to_json() for x in layers],
    }


def _named(cw: ChartWorld) -> EgressLayer:
    """A class that names two protected destinations explicitly: the cluster DNS (UDP 53) and
    the NodePort."""
    return EgressLayer(
        "class",
        allow=(
            Allow(f"{CLUSTER_DNS}/32", (PortRange("udp", 53, 53),)),
            Allow(f"{cw.node_address}/32", (PortRange("tcp", 30080, 30080),)),
        ),
    )


async def _check(
    cw: ChartWorld, world: World, ready: dict[str, list[str]], wide: str, named: str
) -> None:
    ctl = world.control
    await asyncio.gather(ctl.up(wide, seconds=300), ctl.up(named, seconds=300))
    # never the pod's resolver (the cluster DNS): the node's upstream one
    assert ready["dns"] == [world.dns]
    assert {f"{cw.node_address}/32", SERVICE_CIDR, POD_CIDR} <= set(ready["protected"])
    n = cw.node_address
    forbidden = [
        f"tcp {n} 10250",  # kubelet
        f"tcp {n} 22",  # sshd
        f"tcp {n} 30080",  # a NodePort
        f"tcp {NODE_GW} 10250",  # the node, by its end of the pod's link
        f"tcp {AGENT_POD} 9464",  # the agent pod itself
        f"tcp {KUBERNETES} 443",  # a Service
        f"tcp {POD_B} 80",  # another pod
        f"dns kubernetes.default.svc.cluster.local {CLUSTER_DNS}",  # the cluster's DNS
    ]
    got = await ctl.run(wide, "resolvers", f"tcp {world.a} 80", "dns github.test", *forbidden)
    assert got == [f"ok:{world.dns}_", "ok:internet-a", f"ok:{world.a}"] + ["fail"] * len(
        forbidden
    ), got
    # a policy that names them reaches exactly those
    got = await ctl.run(
        named,
        f"dns kubernetes.default.svc.cluster.local {CLUSTER_DNS}",
        f"tcp {n} 30080",
        f"tcp {n} 10250",
        f"tcp {KUBERNETES} 443",
        f"tcp {world.a} 80",
    )
    assert got == [f"ok:{KUBERNETES}", "ok:nodeport", "fail", "fail", "ok:internet-a"], got


async def test_process_sandboxes_of_a_chart_agent_reach_neither_node_nor_cluster(
    chart_world: ChartWorld, world: World, probe_images: tuple[str, str], tmp_path: Path
) -> None:
    cw = chart_world
    vms = [
        _vm("chart-wide", probe_images, world, (WIDE,)),
        _vm("chart-named", probe_images, world, (_named(cw),)),
    ]
    async with harness(cw, world, tmp_path, "process", vms) as ready:
        await _check(cw, world, ready, "chart-wide", "chart-named")


async def test_qemu_guests_of_a_chart_agent_reach_neither_node_nor_cluster(
    chart_world: ChartWorld, world: World, probe_images: tuple[str, str],
    qemu_runtime: QemuRuntime, tmp_path: Path,
) -> None:  # fmt: skip
    cw = chart_world
    boot = tmp_path / "qemu.pickle"
    boot.write_bytes(
        pickle.dumps((qemu_runtime.kernel, qemu_runtime.initramfs, qemu_runtime.accel))
    )
    vms = [
        _vm("chart-qwide", probe_images, world, (WIDE,)),
        _vm("chart-qnamed", probe_images, world, (_named(cw),)),
    ]
    async with harness(cw, world, tmp_path, "qemu", vms, qemu=boot) as ready:
        await _check(cw, world, ready, "chart-qwide", "chart-qnamed")
