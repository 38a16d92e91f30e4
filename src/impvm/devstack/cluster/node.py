"""One node of the test cluster: Debian's containerd (its own socket, root, state, runc root and
CNI configuration) and a kubelet and kube-proxy built from k8s.io/kubernetes, all three in the
node's network namespace, in the node's mount namespace and in the node's cgroup subtree, which
is also the kubelet's ``cgroupRoot``'s parent.

The mount namespace (one per node, shared by its three processes, so the volumes kubelet mounts
are the ones containerd binds into containers) is a slave of the host's: the host's mounts show
in it, its own (kubelet's volumes, containerd's snapshots) stay in it and go with it. In it each
of :data:`NODE_DIRS` is the node's own directory, as on a machine of its own: a pod's
``hostPath`` there (the agent's image cache and VM scratch) is not shared with the other node.

Settings a kubelet needs on this kind of machine (cgroup v1 hybrid, no systemd):
``cgroupDriver: cgroupfs``, ``failCgroupV1: false``, ``failSwapOn: false``; containerd's
``restrict_oom_score_adj = true`` (a sandbox may not lower its ``oom_score_adj`` here) and runc
(crun refuses hybrid cgroups).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from impvm.devstack.cluster import cgroups
from impvm.devstack.cluster.network import NodeAddress
from impvm.kube.controlplane import ControlPlane

CNI_BIN = Path("/usr/lib/cni")
#: host directories each node has of its own (bind-mounted in its mount namespace)
NODE_DIRS = (Path("/var/lib/impvm"),)
RUNC = Path("/usr/sbin/runc")
CLUSTER_DNS = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
#: sysctls the chart's agent pod asks for (README: kubelet --allowed-unsafe-sysctls)
ALLOWED_UNSAFE_SYSCTLS = ("net.ipv4.ip_forward",)


class NodeError(RuntimeError):
    """A node's process did not start or exited; the message carries its log's tail."""


def _must(args: list[str]) -> None:
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise NodeError(f"{' '.join(args)}: {out.stderr.strip()}")


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for these paths


def containerd_config(workdir: Path, rundir: Path, sandbox_image: str) -> str:
    """containerd 1.6's configuration (version 2) for a node under ``workdir``, its sockets in
    ``rundir``."""
    w = workdir
    q = _toml_str
    return f"""version = 2
root = {q(str(w / "root"))}
state = {q(str(w / "state"))}
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = {q(str(rundir / "containerd.sock"))}

[ttrpc]
  address = {q(str(rundir / "containerd.sock.ttrpc"))}

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {q(sandbox_image)}
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  enable_selinux = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = {q(str(RUNC))}
        Root = {q(str(w / "runc"))}
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {q(str(CNI_BIN))}
    conf_dir = {q(str(w / "cni"))}
    max_conf_num = 1

  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = {q(str(w / "certs.d"))}
"""


def registry_hosts(registry: str, ca: Path) -> str:
    """containerd's ``hosts.toml`` for the cluster's registry: HTTPS verified with ``ca``."""
    return (
        f'server = "https://{registry}"\n\n'
        f'[host."https://{registry}"]\n'
        f'  capabilities = ["pull", "resolve"]\n'
        f"  ca = {_toml_str(str(ca))}\n"
    )


def cni_config(pod_subnet: str, ipam_dir: Path) -> dict[str, object]:
    """A bridge + host-local network for the node's pod subnet (Debian's
    containernetworking-plugins); the node routes and masquerades (cluster network)."""
    return {
        "cniVersion": "1.0.0",
        "name": "impvm-cluster",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


@dataclass
class ClusterNode:
    """One node; see the module docstring. ``cgroup``: the node's subtree (relative to each
    hierarchy); the kubelet's ``cgroupRoot`` is ``cgroup/pods``, the runtime's processes sit in
    ``cgroup/runtime``."""

    address: NodeAddress
    workdir: Path
    assets: Path
    control_plane: ControlPlane
    pod_cidr: str
    cgroup: str
    sandbox_image: str
    registry: str
    registry_ca: Path
    #: where the node's sockets are (a short path)
    rundir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.address.name

    @property
    def containerd_dir(self) -> Path:
        return self.workdir / "containerd"

    @property
    def socket(self) -> Path:
        return self.rundir / "containerd.sock"

    @property
    def kubelet_dir(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def mount_ns(self) -> Path:
        """The file holding the node's mount namespace (under the cluster's private ``ns``)."""
        return self.workdir.parent / "ns" / self.name

    def _make_mount_ns(self) -> None:
        """Create the node's mount namespace and bind its own :data:`NODE_DIRS` in it."""
        self.mount_ns.touch()
        _must(["unshare", f"--mount={self.mount_ns}", "--propagation", "slave", "true"])
        for d in NODE_DIRS:
            own = self.workdir / "host" / str(d).strip("/").replace("/", "-")
            own.mkdir(parents=True, exist_ok=True)
            d.mkdir(parents=True, exist_ok=True)  # the mount point, on the host
            _must(
                ["nsenter", f"--mount={self.mount_ns}", "--", "mount", "--bind", str(own), str(d)]
            )

    def _write(self) -> None:
        cd = self.containerd_dir
        for d in (cd / "cni", cd / "certs.d" / self.registry, self.kubelet_dir, self.workdir):
            d.mkdir(parents=True, exist_ok=True)
        self.rundir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (cd / "config.toml").write_text(containerd_config(cd, self.rundir, self.sandbox_image))
        (cd / "certs.d" / self.registry / "hosts.toml").write_text(
            registry_hosts(self.registry, self.registry_ca)
        )
        (cd / "cni" / "10-impvm.conflist").write_text(
            json.dumps(cni_config(self.address.pod_subnet, self.workdir / "cni-ipam"), indent=2)
        )
        cp = self.control_plane
        cp.client_kubeconfig(
            self.workdir / "kubelet.kubeconfig", f"system:node:{self.name}", ["system:nodes"]
        )
        cp.client_kubeconfig(self.workdir / "kube-proxy.kubeconfig", "system:kube-proxy", [])
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("# the test cluster has no upstream resolver\n")
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup}/pods",
            "failSwapOn": False,
            "failCgroupV1": False,
            "address": self.address.address,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(cp.pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(self.workdir / "pod-logs"),
            "allowedUnsafeSysctls": list(ALLOWED_UNSAFE_SYSCTLS),
            # the nodes share one disk with the rest of the machine: evict on nothing but memory
            "evictionHard": {"memory.available": "100Mi"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
        }
        (self.workdir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet))
        proxy = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.workdir / "kube-proxy.kubeconfig")},
            "mode": "nftables",
            "clusterCIDR": self.pod_cidr,
            "hostnameOverride": self.name,
            "bindAddress": self.address.address,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # conntrack limits are the machine's, not a node's: leave them alone
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        (self.workdir / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy))

    def _spawn(self, name: str, args: list[str]) -> None:
        """Run ``args`` in the node's network and mount namespaces and its ``runtime`` cgroup
        (joined by a shell before it execs, so nothing the process forks escapes the subtree)."""
        log = open(self.workdir / f"{name}.log", "ab")
        join = ":".join(str(p) for p in cgroups.procs_files(f"{self.cgroup}/runtime"))
        wrapper = (
            'IFS=:; for f in $IMPVM_CGROUP_PROCS; do echo $$ > "$f"; done; unset IFS; exec "$@"'
        )
        self.procs[name] = subprocess.Popen(
            [
                "sh",
                "-c",
                wrapper,
                "sh",
                "nsenter",
                f"--net=/run/netns/{self.address.netns}",
                f"--mount={self.mount_ns}",
                "--",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "IMPVM_CGROUP_PROCS": join},
        )
        log.close()

    def _check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise NodeError(f"{self.name}: {name} exited with {p.returncode}:\n{tail}")

    def start_runtime(self, timeout: float = 60.0) -> None:
        """Write the configuration, start containerd and wait for its socket."""
        cgroups.create(f"{self.cgroup}/runtime")
        cgroups.create(f"{self.cgroup}/pods")
        self._write()
        self._make_mount_ns()
        self._spawn(
            "containerd",
            ["containerd", "--config", str(self.containerd_dir / "config.toml")],
        )
        deadline = time.monotonic() + timeout
        while not self.socket.is_socket():
            self._check()
            if time.monotonic() > deadline:
                raise NodeError(f"{self.name}: containerd socket missing after {timeout}s")
            time.sleep(0.1)

    def start_kubelet(self) -> None:
        """Start kubelet and kube-proxy (the caller waits for the Node to be Ready)."""
        self._spawn(
            "kubelet",
            [
                str(self.assets / "kubelet"),
                "--config",
                str(self.workdir / "kubelet.yaml"),
                "--kubeconfig",
                str(self.workdir / "kubelet.kubeconfig"),
                "--root-dir",
                str(self.kubelet_dir),
                "--cert-dir",
                str(self.workdir / "kubelet-pki"),
                "--hostname-override",
                self.name,
                "--node-ip",
                self.address.address,
                "--v",
                "1",
            ],
        )
        self._spawn(
            "kube-proxy",
            [
                str(self.assets / "kube-proxy"),
                "--config",
                str(self.workdir / "kube-proxy.yaml"),
                "--v",
                "1",
            ],
        )

    def check(self) -> None:
        """Raise :class:`NodeError` when one of the node's processes exited."""
        self._check()

    def stop(self, timeout: float = 20.0) -> None:
        """Stop kube-proxy and kubelet (SIGTERM), then containerd; whatever runs in the node's
        cgroups afterwards (shims, containers, VMs) is killed by the cluster."""
        for name in ("kube-proxy", "kubelet", "containerd"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
