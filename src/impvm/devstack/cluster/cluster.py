"""A real multi-node Kubernetes cluster on this machine, for tests and benchmarks: the control
plane of :mod:`impvm.kube.controlplane` (``for_nodes``: ``Node,RBAC``, NodeRestriction,
every default controller, kube-scheduler) on the address of a host bridge, a loopback-style
image registry (Debian's docker-registry) on that address, nodes that are each a network
namespace with containerd, kubelet and kube-proxy (:mod:`.node`, :mod:`.network`), and CoreDNS
(:mod:`.addons`).

Usage::

    async with Cluster(ClusterConfig(name="mine")) as c:
        c.kubeconfig   # admin kubeconfig (system:masters)
        c.registry     # "HOST:PORT": push images here, reference them by digest

Everything made is recorded first (:mod:`.state`), so :meth:`Cluster.stop`, the next start of
the same name, or any start after a crashed owner removes it. Needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from impvm.devstack.cluster import addons, cgroups, state
from impvm.devstack.cluster.images import binary_image
from impvm.devstack.cluster.network import ClusterNetwork
from impvm.devstack.cluster.node import ClusterNode
from impvm.devstack.netns import NetNamespace, run_token
from impvm.devstack.registry import LocalRegistry
from impvm.kube.controlplane import ControlPlane

ASSETS = ("kubelet", "kube-scheduler", "kube-proxy", "coredns", "pause")


class ClusterError(RuntimeError):
    """The cluster could not be built or started; the message says which part and why."""


def build_script() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "build-cluster.sh"


def find_assets() -> Path:
    """The directory with every binary the cluster runs: ``IMPVM_CLUSTER_ASSETS``, or
    build-cluster.sh's cache (built when missing: minutes the first time). Raises
    :class:`ClusterError`."""
    env = os.environ.get("IMPVM_CLUSTER_ASSETS")
    if env:
        path = Path(env)
        missing = [b for b in ("etcd", "kube-apiserver", *ASSETS) if not (path / b).exists()]
        if missing:
            raise ClusterError(f"IMPVM_CLUSTER_ASSETS={env} lacks {', '.join(missing)}")
        return path
    proc = subprocess.run(["bash", str(build_script())], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError("building the cluster's binaries failed:\n" + proc.stderr[-4000:])
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass
class ClusterConfig:
    """``name``: the cluster's directory under ``base`` (a start removes an older cluster of
    that name); ``nodes``: how many nodes (``node-1``...); ``timeout``: seconds each step may
    take."""

    name: str = "default"
    nodes: int = 2
    base: Path = state.DEFAULT_BASE
    timeout: float = 240.0


@dataclass
class Cluster:
    """See the module docstring."""

    config: ClusterConfig = field(default_factory=ClusterConfig)
    record: state.ClusterRecord | None = None
    network: ClusterNetwork | None = None
    control_plane: ControlPlane | None = None
    nodes: list[ClusterNode] = field(default_factory=list)
    _registry: LocalRegistry | None = None
    started_seconds: float = 0.0

    @property
    def workdir(self) -> Path:
        return self.config.base / self.config.name

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane is not None, "start() first"
        return self.control_plane.kubeconfig

    @property
    def kubectl_path(self) -> Path:
        assert self.control_plane is not None, "start() first"
        return self.control_plane.kubectl

    @property
    def registry(self) -> str:
        assert self._registry is not None, "start() first"
        return self._registry.address

    @property
    def ca(self) -> Path:
        """The cluster's CA certificate (API server, kubelets' clients, the registry)."""
        assert self.control_plane is not None, "start() first"
        return self.control_plane.pki / "ca.crt"

    @property
    def internet(self) -> NetNamespace:
        """The stand-in internet namespace (bind servers there with ``.socket(address)``)."""
        net = self._net()
        return NetNamespace(
            name=net.internet_ns,
            host_if=f"iki{net.token}",
            network=net.internet_network,
            host_address="",
            addresses=[net.internet_address],
        )

    def _net(self) -> ClusterNetwork:
        assert self.network is not None, "start() first"
        return self.network

    def _rec(self) -> state.ClusterRecord:
        assert self.record is not None, "start() first"
        return self.record

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run kubectl with the admin kubeconfig; return stdout. Raises
        :class:`ClusterError` with stderr when ``check`` and it fails."""
        proc = subprocess.run(
            [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {proc.stderr.strip()[-2000:]}")
        return proc.stdout

    def _adopt(self, pid: int | None) -> None:
        """Move a control-plane process into the cluster's cgroup (crash cleanup finds it)."""
        if pid is None:
            return
        for f in cgroups.procs_files(f"{self._rec().cgroup}/control-plane"):
            with contextlib.suppress(OSError):
                f.write_text(str(pid))

    async def _wait(self, what: str, check: Any) -> None:
        deadline = time.monotonic() + self.config.timeout
        last = ""
        while time.monotonic() < deadline:
            for node in self.nodes:
                node.check()
            try:
                if await asyncio.to_thread(check):
                    return
            except (ClusterError, ValueError, KeyError) as e:
                last = str(e)
            await asyncio.sleep(0.5)
        raise ClusterError(f"{what} not ready after {self.config.timeout}s {last}")

    def _private_ns_dir(self) -> None:
        """``workdir/ns``, a private mount: the nodes' mount namespaces are bound to files in
        it (a namespace file may not sit on a shared mount)."""
        d = self.workdir / "ns"
        d.mkdir(exist_ok=True)
        for args in (["mount", "--bind", str(d), str(d)], ["mount", "--make-private", str(d)]):
            out = subprocess.run(args, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise ClusterError(f"{' '.join(args)}: {out.stderr.strip()}")

    def _nodes_ready(self) -> bool:
        got = json.loads(self.kubectl("get", "nodes", "-o", "json"))
        ready = {
            n["metadata"]["name"]
            for n in got["items"]
            for c in n.get("status", {}).get("conditions", [])
            if c["type"] == "Ready" and c["status"] == "True"
        }
        return ready >= {n.name for n in self.nodes}

    def _dns_ready(self) -> bool:
        got = json.loads(
            self.kubectl("-n", "kube-system", "get", "deployment", "coredns", "-o", "json")
        )
        return int(got.get("status", {}).get("availableReplicas") or 0) >= 1

    async def start(self) -> Cluster:
        """Remove what an older cluster of this name or a crashed one left, then start every
        part and wait until the nodes are Ready and CoreDNS is available. Raises
        :class:`ClusterError` (call :meth:`stop` to clean up)."""
        t0 = time.monotonic()
        cfg = self.config
        # kubelet keeps unix sockets under its root directory (at most 107 bytes a path)
        longest = self.workdir / "node-0" / "kubelet" / "pod-resources" / "123456789"
        if len(str(longest)) > 100:
            raise ClusterError(
                f"the cluster directory {self.workdir} is too long a path for kubelet's sockets; "
                "choose a shorter base (IMPVM_CLUSTER_DIR)"
            )
        await asyncio.to_thread(state.remove_stale, cfg.base, cfg.name)
        assets = await asyncio.to_thread(find_assets)
        token = run_token()
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        me = os.getpid()
        rec = self.record = state.ClusterRecord(
            name=cfg.name,
            token=token,
            workdir=str(self.workdir),
            owner_pid=me,
            owner_start=state.process_start(me),
            cgroup=f"impvm-cluster-{token}",
            rundir=f"/run/impvm-cluster-{token}",
        )
        rec.save()
        await asyncio.to_thread(cgroups.create, f"{rec.cgroup}/control-plane")
        names = [f"node-{i + 1}" for i in range(cfg.nodes)]
        net = self.network = ClusterNetwork(token, names).plan()
        rec.netns, rec.links = net.netns, net.links
        try:
            await asyncio.to_thread(net.create, rec.save)
        finally:
            rec.save()

        cp = self.control_plane = ControlPlane(
            workdir=self.workdir / "control-plane",
            assets=assets,
            address=net.host_address,
            bind_address=net.host_address,
            for_nodes=True,
            timeout=cfg.timeout,
        )
        await asyncio.to_thread(self._private_ns_dir)
        await asyncio.to_thread(cp.start)
        for p in cp.procs.values():
            self._adopt(p.pid)
        # HTTPS with the cluster's CA: pods reach it on a node-network address, and the agent
        # takes plain HTTP only from loopback registries
        crt, key = cp.serving_certificate("registry", (net.host_address,))
        reg = self._registry = LocalRegistry(
            host=net.host_address,
            storage_dir=self.workdir / "registry",
            tls=(crt, key, cp.pki / "ca.crt"),
        )
        await reg.start()
        self._adopt(reg.pid)
        pause = await binary_image(
            self.workdir / "images" / "pause",
            reg.address,
            "impvm-cluster/pause",
            assets / "pause",
            ["/pause"],
        )
        coredns = await binary_image(
            self.workdir / "images" / "coredns",
            reg.address,
            "impvm-cluster/coredns",
            assets / "coredns",
            ["/coredns"],
        )
        for addr in net.nodes:
            node = ClusterNode(
                address=addr,
                workdir=self.workdir / addr.name,
                assets=assets,
                control_plane=cp,
                pod_cidr=net.pod_cidr,
                cgroup=f"{rec.cgroup}/{addr.name}",
                sandbox_image=pause,
                registry=reg.address,
                registry_ca=cp.pki / "ca.crt",
                rundir=Path(rec.rundir) / addr.name,
            )
            self.nodes.append(node)
            await asyncio.to_thread(node.start_runtime)
            node.start_kubelet()
        await self._wait("nodes", self._nodes_ready)
        docs = addons.manifests(coredns)
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        await self._wait("CoreDNS", self._dns_ready)
        self.started_seconds = time.monotonic() - t0
        return self

    def check(self) -> None:
        """Raise when a node's or the control plane's process exited."""
        for node in self.nodes:
            node.check()
        if self.control_plane is not None and (dead := self.control_plane.dead()):
            raise ClusterError(f"control-plane processes exited: {', '.join(dead)}")

    async def stop(self) -> None:
        """Stop every process and remove everything the cluster made. Idempotent. The nodes are
        not drained: their processes, pods and VMs are killed with the cgroup subtree (nothing of
        them is kept, and a graceful kubelet and containerd stop takes a minute)."""
        if self._registry is not None:
            await self._registry.stop()
            self._registry = None
        if self.record is not None and self.record.cgroup:
            await asyncio.to_thread(cgroups.kill, self.record.cgroup)
        for node in self.nodes:
            await asyncio.to_thread(node.stop)
        self.nodes.clear()
        if self.control_plane is not None:
            await asyncio.to_thread(self.control_plane.stop)
            self.control_plane = None
        if self.record is not None:
            await asyncio.to_thread(state.remove, self.record, state.CACHES)
            self.record = None

    async def __aenter__(self) -> Cluster:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
