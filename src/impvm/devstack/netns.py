"""Network namespaces the development stack and the tests make: a stand-in "internet" (where
the GitHub stand-in lives, reached by guests through the node's NAT exactly as they would reach
GitHub) and other test hosts, each joined to the host by a veth pair; and :class:`GuestRoutes`,
which confines guest traffic to those namespaces (policy routing: a guest packet to anything
else hits a blackhole route, so a development VM never sends a packet off this machine).

Everything here needs root (CAP_NET_ADMIN) and uses ``ip`` (Debian ``iproute2``). Names carry a
per-run token so concurrent stacks on one machine do not collide; :meth:`NetNamespace.delete`
and :meth:`GuestRoutes.delete` are idempotent.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import random
import re
import secrets
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

_CLONE_NEWNET = 0x40000000

#: Documentation ranges (RFC 5737) the stand-in internet is carved from: public to a guest's
#: egress policy, and routed nowhere in the real world.
INTERNET_RANGES = ("203.0.113.0/24", "198.51.100.0/24")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def run_token() -> str:
    """Four hex characters naming one run's interfaces, namespaces and tables."""
    return secrets.token_hex(2)


def used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks routed or addressed on this host (every routing table)."""
    nets: list[ipaddress.IPv4Network] = []
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(dst, strict=False))
    for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def pick_subnet(ranges: tuple[str, ...], prefixlen: int, avoid: tuple[str, ...] = ()) -> str:
    """A random ``/prefixlen`` inside one of ``ranges`` that overlaps nothing routed or
    addressed on this host, nor ``avoid``. Raises ``RuntimeError`` when none is free."""
    taken = used_networks() + [ipaddress.IPv4Network(a) for a in avoid]
    candidates = [
        sub
        for r in ranges
        for sub in ipaddress.IPv4Network(r).subnets(new_prefix=prefixlen)
        if not any(sub.overlaps(t) for t in taken)
    ]
    if not candidates:
        raise RuntimeError(f"no free /{prefixlen} in {', '.join(ranges)}")
    return str(random.choice(candidates))


@dataclass
class NetNamespace:
    """A namespace ``name`` holding ``addresses`` on its ``eth0``, joined to the host by the veth
    ``host_if`` whose host end has ``host_address``.

    ``host_route``: the host routes the namespace's network through ``host_if`` (the operator
    reaching the stand-in). Without it the host end holds a /32 and only :class:`GuestRoutes`
    routes to the namespace - so a test host can own an address the host itself must keep
    (169.254.169.254, a private range) without touching the host's own routing.
    """

    name: str
    host_if: str
    network: str
    host_address: str
    addresses: list[str]
    host_route: bool = True
    created: bool = field(default=False, init=False)

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.name

    def create(self) -> NetNamespace:
        """Make the namespace, the veth pair and the addresses. Raises ``RuntimeError``."""
        net = ipaddress.IPv4Network(self.network)
        try:
            _ip("netns", "add", self.name)
            self.created = True
            _ip(
                "link",
                "add",
                self.host_if,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                self.name,
            )
            host_len = net.prefixlen if self.host_route else 32
            _ip("addr", "add", f"{self.host_address}/{host_len}", "dev", self.host_if)
            _ip("link", "set", "dev", self.host_if, "up")
            ns = ["-n", self.name]
            _ip(*ns, "link", "set", "dev", "lo", "up")
            for a in self.addresses:
                _ip(*ns, "addr", "add", f"{a}/{net.prefixlen}", "dev", "eth0")
            _ip(*ns, "link", "set", "dev", "eth0", "up")
            if not net.overlaps(ipaddress.IPv4Network(f"{self.host_address}/32")):
                _ip(*ns, "route", "add", self.host_address, "dev", "eth0")
        except Exception:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        """Remove the namespace and the veth pair. Idempotent."""
        _ip("link", "del", "dev", self.host_if, check=False)
        if self.netns_path.exists():
            _ip("netns", "del", self.name, check=False)
        self.created = False

    def exec_args(self, *args: str) -> list[str]:
        """``args`` run inside the namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.name, *args]

    def socket(self, address: str, port: int = 0, kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket bound to ``address``:``port`` *inside* the namespace (TCP: listening), made
        in a short-lived thread that joins the namespace (``setns``); the socket stays there
        while this process serves it from any thread."""
        result: list[socket.socket] = []
        errors: list[BaseException] = []

        def work() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(self.netns_path, os.O_RDONLY)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.name}")
                finally:
                    os.close(fd)
                s = socket.socket(socket.AF_INET, kind)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((address, port))
                if kind == socket.SOCK_STREAM:
                    s.listen(128)
                result.append(s)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=work, name=f"netns-{self.name}")
        t.start()
        t.join()
        if errors:
            raise errors[0]
        return result[0]


@dataclass
class GuestRoutes:
    """Routes guest traffic (source in ``guest_subnet``) by its own table ``table``: to each of
    ``namespaces`` through its veth, the guest subnet itself as usual (so node-side rules, not
    routing, decide guest-to-guest traffic), and a blackhole for everything else."""

    guest_subnet: str
    table: int
    namespaces: list[NetNamespace]
    priority: int = 0
    created: bool = field(default=False, init=False)

    def create(self) -> GuestRoutes:
        """Install the rule and the table. Raises ``RuntimeError``."""
        t = str(self.table)
        try:
            self.created = True
            for ns in self.namespaces:
                _ip("route", "add", ns.network, "dev", ns.host_if, "table", t)
            _ip("route", "add", "throw", self.guest_subnet, "table", t)
            _ip("route", "add", "blackhole", "default", "table", t)
            prio = str(self.priority or self.table % 30000 + 100)
            _ip("rule", "add", "from", self.guest_subnet, "lookup", t, "priority", prio)
        except Exception:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        """Remove the rule and flush the table. Idempotent."""
        if not self.created:
            return
        t = str(self.table)
        while (
            _ip("rule", "del", "from", self.guest_subnet, "lookup", t, check=False).returncode == 0
        ):
            pass
        _ip("route", "flush", "table", t, check=False)
        self.created = False


__all__ = [
    "GUEST_RANGES",
    "INTERNET_RANGES",
    "DevNetwork",
    "GuestRoutes",
    "NetNamespace",
    "pick_subnet",
    "run_token",
    "used_networks",
]


#: Where development and test guest subnets are carved from (a /24 each).
GUEST_RANGES = ("10.200.0.0/13",)


@dataclass
class DevNetwork:
    """The development stack's networks: a guest subnet and names of its own for the agent
    (``--guest-subnet``, ``--network-table``, ``--network-prefix``), the stand-in internet
    namespace (``internet``: the stand-in listens on ``server_address`` there; the host routes
    to it, so the operator reaches it as it would reach GitHub), and :class:`GuestRoutes` that
    let guests reach only that namespace."""

    token: str
    guest_subnet: str
    internet: NetNamespace
    routes: GuestRoutes

    @classmethod
    def create(cls) -> DevNetwork:
        """Make the namespace and the routes. Raises ``RuntimeError`` (nothing is left)."""
        token = run_token()
        guest = pick_subnet(GUEST_RANGES, 24)
        inet = ipaddress.IPv4Network(pick_subnet(INTERNET_RANGES, 29))
        internet = NetNamespace(
            name=f"impvm-inet-{token}",
            host_if=f"ivi{token}",
            network=str(inet),
            host_address=str(inet.network_address + 6),
            addresses=[str(inet.network_address + 1)],
        ).create()
        try:
            routes = GuestRoutes(guest, 20000 + int(token, 16) % 40000, [internet]).create()
        except Exception:
            internet.delete()
            raise
        return cls(token, guest, internet, routes)

    @property
    def server_address(self) -> str:
        """The stand-in's address in the internet namespace."""
        return self.internet.addresses[0]

    @property
    def table(self) -> str:
        return f"ivt{self.token}"

    @property
    def ifprefix(self) -> str:
        return f"iv{self.token}"

    def agent_args(self) -> list[str]:
        """``impvm agent`` options for guests on these networks (no resolver: the stand-in is
        reached by address)."""
        return [
            "--guest-network",
            "isolated",
            "--guest-subnet",
            self.guest_subnet,
            "--network-table",
            self.table,
            "--network-prefix",
            self.ifprefix,
            "--guest-dns",
            "none",
        ]

    def delete(self) -> None:
        """Remove the routes, the namespace, and whatever an agent on these networks left
        (its interfaces, per-VM namespaces and table). Idempotent."""
        self.routes.delete()
        self.internet.delete()
        mine = re.compile(rf"^{self.ifprefix}-\d+$")
        for link in json.loads(_ip("-j", "link", "show").stdout or "[]"):
            if mine.match(str(link.get("ifname", ""))):
                _ip("link", "del", "dev", link["ifname"], check=False)
        with contextlib.suppress(OSError):
            for name in os.listdir("/run/netns"):
                if mine.match(name):
                    _ip("netns", "del", name, check=False)
        subprocess.run(
            ["nft", "delete", "table", "inet", self.table], capture_output=True, timeout=30
        )
