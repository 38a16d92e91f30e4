"""The node's network plan, as pure functions: its settings (:class:`NetConfig`), address slots,
interface names, the record of one VM's network (:class:`Attachment`) and the ``ip`` commands
that create it. The nftables ruleset for them is :mod:`impvm.agent.network.ruleset`.

Addressing: the guest subnet (``NetConfig.subnet``, default ``10.213.0.0/16``) is cut into /30
*slots*; slot ``s`` is ``base + 4s``: ``.1`` is the node's end (the guest's gateway), ``.2`` the
guest. Each slot is its own point-to-point link (a tap device for a QEMU guest, a veth pair into
a per-VM network namespace for a process sandbox), named ``<ifprefix>-<s>``: there is no bridge,
so guests share no layer-2 segment and any guest-to-guest packet has to be routed by the node,
where the ``forward`` chain drops it.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from impvm.agent.network.policy import DEFAULT_LAYER, EgressLayer, collapse

Kind = Literal["tap", "netns"]

#: Default guest subnet: 16384 slots.
DEFAULT_SUBNET = "10.213.0.0/16"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_TABLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class NetConfigError(ValueError):
    """A network setting is invalid (the message names it)."""


@dataclass(frozen=True)
class NetConfig:
    """Settings of one node's guest networks.

    ``table``: nftables table name (``inet`` family); ``ifprefix``: name prefix of the guest
    interfaces and per-VM namespaces (``[a-z][a-z0-9]{0,7}``; names are ``<prefix>-<slot>``, so
    two agents with different prefixes never match each other's wildcard); ``subnet``: IPv4 guest
    subnet, /16 to /28; ``dns``: IPv4 resolvers guests use and may always reach on port 53 (but
    see ``protected``); ``protected``: IPv4 networks no guest reaches unless every layer of its
    policy names them explicitly - the node's addresses as seen from where the guests' traffic
    leaves (in a pod: the node's, not the pod's own, which ``input`` guards) and the cluster's
    pod, service and DNS networks (:mod:`impvm.agent.network.cluster`); kept collapsed and
    canonical. A resolver inside them is neither given to guests nor let through.
    """

    table: str = "impvm"
    ifprefix: str = "impvm"
    subnet: str = DEFAULT_SUBNET
    dns: tuple[str, ...] = ()
    protected: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _TABLE_RE.match(self.table):
            raise NetConfigError(f"network table {self.table!r}: want [a-z][a-z0-9_]{{0,31}}")
        if not _PREFIX_RE.match(self.ifprefix):
            raise NetConfigError(f"interface prefix {self.ifprefix!r}: want [a-z][a-z0-9]{{0,7}}")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            raise NetConfigError(f"guest subnet {self.subnet!r}: {exc}") from None
        if not 16 <= net.prefixlen <= 28:
            raise NetConfigError(f"guest subnet {self.subnet}: prefix length must be 16..28")
        for d in self.dns:
            try:
                ipaddress.IPv4Address(d)
            except ValueError:
                raise NetConfigError(f"guest DNS resolver {d!r}: not an IPv4 address") from None
        for p in self.protected:
            try:
                ipaddress.IPv4Network(p, strict=False)
            except ValueError:
                raise NetConfigError(f"protected network {p!r}: not an IPv4 CIDR") from None
        object.__setattr__(self, "protected", collapse(self.protected))

    def is_protected(self, address: str) -> bool:
        """Whether ``address`` (IPv4) lies in the protected networks."""
        addr = ipaddress.IPv4Address(address)
        return any(addr in ipaddress.IPv4Network(p) for p in self.protected)

    @property
    def reachable_dns(self) -> tuple[str, ...]:
        """The resolvers guests are given and may reach: ``dns`` outside ``protected``."""
        return tuple(d for d in self.dns if not self.is_protected(d))

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def slots(self) -> int:
        """Number of /30 slots in the subnet."""
        return self.network.num_addresses // 4

    def ifname(self, slot: int) -> str:
        """Interface (and per-VM namespace) name of ``slot``: ``<prefix>-<slot>``."""
        return f"{self.ifprefix}-{slot}"

    def slot_of(self, ifname: str) -> int | None:
        """The slot an interface or namespace name stands for, or ``None`` if not ours."""
        head, sep, tail = ifname.partition("-")
        if head != self.ifprefix or not sep or not tail.isdigit() or tail != str(int(tail)):
            return None
        slot = int(tail)
        return slot if slot < self.slots else None

    def gateway(self, slot: int) -> str:
        """The node's address on ``slot`` (the guest's default gateway)."""
        return str(self.network.network_address + 4 * slot + 1)

    def guest_address(self, slot: int) -> str:
        """The guest's address on ``slot``."""
        return str(self.network.network_address + 4 * slot + 2)


@dataclass(frozen=True)
class Attachment:
    """One VM's network on this node (what the agent records and rebuilds from).

    ``vm_id``: the runtime's VM id; ``namespace``/``name``: the ImpVM (for log prefixes);
    ``slot``; ``kind``: ``tap`` (QEMU) or ``netns`` (process sandbox: a veth into namespace
    ``<prefix>-<slot>``); ``layers``: egress layers (empty: :data:`DEFAULT_LAYER`); ``workdir``:
    the VM's private directory (a record whose workdir is gone is stale)."""

    vm_id: str
    namespace: str
    name: str
    slot: int
    kind: Kind
    layers: tuple[EgressLayer, ...]
    workdir: str

    def effective_layers(self) -> tuple[EgressLayer, ...]:
        return self.layers or (DEFAULT_LAYER,)

    def to_json(self) -> str:
        return json.dumps(
            {
                "vmId": self.vm_id,
                "namespace": self.namespace,
                "name": self.name,
                "slot": self.slot,
                "kind": self.kind,
                "layers": [layer.to_json() for layer in self.layers],
                "workdir": self.workdir,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Attachment:
        """Inverse of :meth:`to_json`. Raises ``ValueError``/``KeyError``/``TypeError``."""
        o: dict[str, Any] = json.loads(text)
        kind = o["kind"]
        if kind not in ("tap", "netns"):
            raise ValueError(f"unknown attachment kind {kind!r}")
        return cls(
            vm_id=str(o["vmId"]),
            namespace=str(o["namespace"]),
            name=str(o["name"]),
            slot=int(o["slot"]),
            kind=kind,
            layers=tuple(EgressLayer.from_json(x) for x in o["layers"]),
            workdir=str(o["workdir"]),
        )


def free_slot(used: Iterable[int], slots: int) -> int | None:
    """The lowest slot in ``0..slots-1`` not in ``used``, or ``None`` when all are taken."""
    taken = set(used)
    for s in range(slots):
        if s not in taken:
            return s
    return None


def create_commands(cfg: NetConfig, att: Attachment) -> tuple[list[str], list[str]]:
    """``ip -batch`` lines that create ``att``'s interface on the node, and (``netns`` kind) the
    lines to run inside the VM's namespace (``ip -n <ns> -batch``)."""
    dev = cfg.ifname(att.slot)
    gw, guest = cfg.gateway(att.slot), cfg.guest_address(att.slot)
    host: list[str] = []
    inner: list[str] = []
    if att.kind == "tap":
        host.append(f"tuntap add dev {dev} mode tap vnet_hdr")
    else:
        host += [f"netns add {dev}", f"link add {dev} type veth peer name eth0 netns {dev}"]
        inner = [
            "link set dev lo up",
            f"addr add {guest}/30 dev eth0",
            "link set dev eth0 up",
            f"route add default via {gw}",
        ]
    host += [
        f"link set dev {dev} alias impvm:{att.vm_id}",
        f"addr add {gw}/30 dev {dev}",
        f"link set dev {dev} up",
    ]
    return host, inner


__all__ = [
    "DEFAULT_SUBNET",
    "Attachment",
    "Kind",
    "NetConfig",
    "NetConfigError",
    "create_commands",
    "free_slot",
]
