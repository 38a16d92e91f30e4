"""The test cluster's networks, each node a separate machine:

- a bridge on the host (``ikb<token>``) holding the control plane's address (kube-apiserver and
  the image registry listen there, not on loopback);
- a network namespace per node with its own address on that bridge, a pod subnet of its own
  (``/24`` of the cluster's pod CIDR) and a route to every other node's pod subnet through that
  node, as a routed pod network (kindnet, flannel's host-gw) sets up; traffic of its pods to
  anything outside the pod network leaves masqueraded as the node;
- a router namespace on the bridge, the nodes' default gateway, with a second leg to the stand-in
  "internet" namespace (a documentation range, RFC 5737), which it reaches by NAT as a home
  router does; it has no other link, so nothing a pod sends leaves this machine.

Names carry the cluster's token, so concurrent clusters do not collide; :meth:`delete` removes
what :meth:`create` made and is idempotent. Needs root and ``ip``/``nft``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
from dataclasses import dataclass, field

from impvm.devstack.netns import INTERNET_RANGES, NetNamespace, pick_subnet

#: where nodes' networks (a /24) and pod networks (a /16) are carved from
NODE_RANGES = ("10.208.0.0/14",)
POD_RANGES = ("10.216.0.0/13",)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def _in(ns: str, *args: str) -> None:
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "--", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} in {ns} failed: {out.stderr.strip()}")


def _nft(ns: str, script: str) -> None:
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "--", "nft", "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise RuntimeError(f"nft in {ns} failed: {out.stderr.strip()}\n{script}")


@dataclass(frozen=True)
class NodeAddress:
    """One node's namespace, host-side veth, address and pod subnet."""

    name: str
    netns: str
    host_if: str
    address: str
    pod_subnet: str


@dataclass
class ClusterNetwork:
    """See the module docstring. ``names`` records every namespace and link made so far, for
    the crash cleanup (:mod:`impvm.devstack.cluster.state`)."""

    token: str
    node_names: list[str]
    node_network: str = ""
    pod_cidr: str = ""
    internet_network: str = ""
    nodes: list[NodeAddress] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"ikb{self.token}"

    @property
    def router_ns(self) -> str:
        return f"impvm-clr-{self.token}"

    @property
    def internet_ns(self) -> str:
        return f"impvm-cli-{self.token}"

    @property
    def host_address(self) -> str:
        """The control plane's address on the bridge."""
        return str(ipaddress.IPv4Network(self.node_network).network_address + 1)

    @property
    def router_address(self) -> str:
        return str(ipaddress.IPv4Network(self.node_network).network_address + 254)

    @property
    def internet_address(self) -> str:
        """The first address of the internet namespace (where a test serves GitHub)."""
        return str(ipaddress.IPv4Network(self.internet_network).network_address + 1)

    def plan(self) -> ClusterNetwork:
        """Choose free subnets and the nodes' addresses (nothing is made yet)."""
        self.node_network = pick_subnet(NODE_RANGES, 24)
        self.pod_cidr = pick_subnet(POD_RANGES, 16)
        self.internet_network = pick_subnet(INTERNET_RANGES, 29)
        net = ipaddress.IPv4Network(self.node_network)
        pods = list(ipaddress.IPv4Network(self.pod_cidr).subnets(new_prefix=24))
        self.nodes = [
            NodeAddress(
                name=n,
                netns=f"impvm-cln{i}-{self.token}",
                host_if=f"ikn{i}{self.token}",
                address=str(net.network_address + 11 + i),
                pod_subnet=str(pods[i + 1]),
            )
            for i, n in enumerate(self.node_names)
        ]
        return self

    def _netns(self, name: str) -> None:
        self.netns.append(name)
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _leg(self, ns: str, host_if: str, address: str) -> None:
        """A veth from the bridge to ``eth0`` of ``ns`` holding ``address``/24."""
        self.links.append(host_if)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def create(self, on_change: object = None) -> ClusterNetwork:
        """Make the bridge, the router, the internet and every node's namespace. ``on_change``
        (a callable) is called after each name is recorded, before the thing is made, so a
        crash in between leaves nothing unrecorded. Raises ``RuntimeError``."""
        notify = on_change if callable(on_change) else (lambda: None)
        self.links.append(self.bridge)
        notify()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

        # the router: the nodes' gateway, NAT to the internet namespace, nothing else
        self._netns(self.router_ns)
        notify()
        self._leg(self.router_ns, f"ikr{self.token}", self.router_address)
        inet = ipaddress.IPv4Network(self.internet_network)
        gateway = str(inet.network_address + 6)
        self.netns.append(self.internet_ns)
        self.links.append(f"iki{self.token}")
        notify()
        NetNamespace(
            name=self.internet_ns,
            host_if=f"iki{self.token}",
            network=str(inet),
            host_address=gateway,
            addresses=[self.internet_address],
            host_route=False,
        ).create()
        _ip("link", "set", f"iki{self.token}", "netns", self.router_ns)
        r = ["-n", self.router_ns]
        _ip(*r, "addr", "add", f"{gateway}/{inet.prefixlen}", "dev", f"iki{self.token}")
        _ip(*r, "link", "set", f"iki{self.token}", "up")
        _ip("-n", self.internet_ns, "route", "add", "default", "via", gateway)
        _in(self.router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _nft(
            self.router_ns,
            f"table ip impvm-router {{\n"
            f"  chain post {{ type nat hook postrouting priority srcnat; "
            f'oifname "iki{self.token}" masquerade; }}\n'
            f"}}\n",
        )

        for node in self.nodes:
            self._netns(node.netns)
            notify()
            self._leg(node.netns, node.host_if, node.address)
            n = ["-n", node.netns]
            _ip(*n, "route", "add", "default", "via", self.router_address)
            for other in self.nodes:
                if other is not node:
                    _ip(*n, "route", "add", other.pod_subnet, "via", other.address)
            # the host reaches pods too (tests, kube-apiserver), through each node
            _ip("route", "add", node.pod_subnet, "via", node.address)
            _in(node.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _nft(
                node.netns,
                f"table ip impvm-node {{\n"
                f"  chain post {{ type nat hook postrouting priority srcnat; "
                f'oifname "eth0" ip saddr {node.pod_subnet} '
                f"ip daddr != {{ {self.pod_cidr}, {self.node_network} }} masquerade; }}\n"
                f"}}\n",
            )
        return self

    def delete(self) -> None:
        """Remove every namespace and link recorded (routes go with them). Idempotent."""
        delete(self.netns, self.links)


def delete(netns: list[str], links: list[str]) -> None:
    """Remove the namespaces and host links named (missing ones are skipped)."""
    for link in reversed(links):
        _ip("link", "del", "dev", link, check=False)
    for ns in reversed(netns):
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", ns, check=False)
