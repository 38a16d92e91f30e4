"""The node's network plan, as pure functions: address slots, interface names, and the nftables
ruleset for the VMs attached on this node.

Addressing: the guest subnet (``NetConfig.subnet``, default ``10.213.0.0/16``) is cut into /30
*slots*; slot ``s`` is ``base + 4s``: ``.1`` is the node's end (the guest's gateway), ``.2`` the
guest. Each slot is its own point-to-point link (a tap device for a QEMU guest, a veth pair into
a per-VM network namespace for a process sandbox), named ``<ifprefix>-<s>``: there is no bridge,
so guests share no layer-2 segment and any guest-to-guest packet has to be routed by the node,
where the ``forward`` chain drops it.

The table (``table inet <table>``, one per agent) is always replaced whole, in one ``nft -f``
transaction (``table {}`` + ``delete table`` + the new table), so it is never half-applied and a
rebuild after a crash is the same operation as any other change. Chains:

* ``input``: a packet from a guest interface to any address of the node (its gateway, the
  uplink's, loopback-bound services reached through a DNAT, broadcast) is rejected, except DNS to
  a configured resolver that lives on the node;
* ``forward``: nothing opens a connection *to* a guest (only replies pass): from another guest
  it is rejected, from anywhere else dropped; a packet from a guest interface is looked up in the
  ``guest_vm`` verdict map (interface name -> the VM's chain); an interface with the prefix the
  map does not know is dropped (fail closed);
* ``vm-<s>``: IPv4 only, the slot's guest address only (no spoofing), replies of connections
  already let through, DNS to the configured resolvers (those outside the protected set), never
  another guest (the whole guest subnet), the protected set (``NetConfig.protected``: the
  node's addresses and the cluster's pod, service and DNS networks) only where every layer
  names it explicitly (chains ``vm-<s>-p<i>``, :func:`~impvm.agent.network.policy.
  names_protected`), then one chain per egress layer (:mod:`impvm.agent.network.policy`), then
  accept;
* ``postrouting`` (nat): guest traffic leaving through any non-guest interface is masqueraded
  behind that interface's address (NAT to the node's uplink).

Rejections use ``icmpx admin-prohibited`` so a job fails fast instead of timing out ("No route to
host"). Guest-to-guest traffic is rejected the same way whether a guest holds the address or not
(a free slot's address is rejected by the sender's chain), so the answer tells a guest nothing
about its neighbours; dropping it instead would have made a live neighbour the one address that
times out. Audit log lines are limited to 20 per second per layer (burst 40) so a scan cannot
flood the kernel log.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from impvm.agent.network.policy import (
    BLOCKED_RANGES,
    DEFAULT_LAYER,
    Allow,
    EgressLayer,
    PortRange,
    collapse,
    explicit_entries,
)

Kind = Literal["tap", "netns"]

#: Default guest subnet: 16384 slots.
DEFAULT_SUBNET = "10.213.0.0/16"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_TABLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: nf_log's prefix limit (NF_LOG_PREFIXLEN, 128 bytes with the terminating NUL).
LOG_PREFIX_MAX = 127
_REJECT = "reject with icmpx type admin-prohibited"
_LIMIT = "limit rate 20/second burst 40 packets"


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


def merge_ports(ports: Sequence[PortRange]) -> dict[str, list[tuple[int, int]]]:
    """Port ranges per protocol, sorted, with overlapping or adjacent ranges merged (nftables
    refuses overlapping intervals in one set)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for proto in ("tcp", "udp"):
        spans = sorted((p.first, p.last) for p in ports if p.protocol == proto)
        merged: list[tuple[int, int]] = []
        for first, last in spans:
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        if merged:
            out[proto] = merged
    return out


def _set(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def log_prefix(layer: str, namespace: str, name: str) -> str:
    """``impvm audit <layer> <namespace>/<name>: `` cut to nf_log's 127 bytes (the VM name is
    shortened first)."""
    head = f"impvm audit {layer} {namespace}/"
    room = LOG_PREFIX_MAX - len(head) - 2
    return f"{head}{name[: max(room, 0)]}: "[:LOG_PREFIX_MAX]


def layer_rules(layer: EgressLayer, prefix: str) -> list[str]:
    """The rules of one layer chain: ``return`` for what the layer lets through, then reject
    (or, with ``audit``, a rate-limited log line) for the rest; the chain's end returns."""
    rules = [f"{m} return" for a in layer.allow for m in _allow_match(a)]
    match = f"ip daddr {_set(list(BLOCKED_RANGES))} " if layer.mode == "public" else ""
    if layer.audit:
        rules.append(f'{match}{_LIMIT} log prefix "{prefix}" level warn')
    else:
        rules.append(f"{match}{_REJECT}")
    return rules


def _dns_rules(cfg: NetConfig) -> list[str]:
    dns = list(cfg.reachable_dns)
    if not dns:
        return []
    return [f"ip daddr {_set(dns)} {proto} dport 53 accept" for proto in ("udp", "tcp")]


def _allow_match(a: Allow) -> list[str]:
    """The matches of one allow entry (one per protocol when it lists ports)."""
    if not a.ports:
        return [f"ip daddr {a.cidr}"]
    out = []
    for proto, spans in merge_ports(a.ports).items():
        items = [str(f) if f == last else f"{f}-{last}" for f, last in spans]
        out.append(f"ip daddr {a.cidr} {proto} dport {_set(items)}")
    return out


def guard_rules(cfg: NetConfig, att: Attachment) -> tuple[list[str], dict[str, list[str]]]:
    """The protected set's rules of chain ``vm-<slot>`` and the chains they jump to: per layer,
    a destination in ``@protected`` is rejected unless one of the layer's explicit entries
    (inside the set) matches; a layer without such entries rejects it outright."""
    if not cfg.protected:
        return [], {}
    rules: list[str] = []
    chains: dict[str, list[str]] = {}
    for i, layer in enumerate(att.effective_layers()):
        named = explicit_entries(layer, cfg.protected)
        if not named:
            rules.append(f"ip daddr @protected {_REJECT}")
            break
        name = f"vm-{att.slot}-p{i}"
        rules.append(f"ip daddr @protected jump {name}")
        chains[name] = [f"{m} return" for a in named for m in _allow_match(a)] + [_REJECT]
    return rules, chains


def vm_chain_rules(cfg: NetConfig, att: Attachment) -> list[str]:
    """The rules of chain ``vm-<slot>`` (see the module docstring)."""
    rules = [
        "meta nfproto != ipv4 drop",
        f"ip saddr != {cfg.guest_address(att.slot)} drop",
        "ct state established,related accept",
        *_dns_rules(cfg),
        f"ip daddr {cfg.subnet} {_REJECT}",
        *guard_rules(cfg, att)[0],
    ]
    rules += [f"jump vm-{att.slot}-{i}" for i, _ in enumerate(att.effective_layers())]
    rules.append("accept")
    return rules


def render(cfg: NetConfig, attachments: Iterable[Attachment]) -> str:
    """The whole ``nft -f`` input that replaces table ``inet <cfg.table>`` atomically with the
    rules for ``attachments`` (ordered by slot; the output is deterministic)."""
    atts = sorted(attachments, key=lambda a: a.slot)
    wild = f'"{cfg.ifprefix}-*"'
    t = cfg.table
    lines = [f"table inet {t} {{}}", f"delete table inet {t}", f"table inet {t} {{"]
    elements = ", ".join(f'"{cfg.ifname(a.slot)}" : jump vm-{a.slot}' for a in atts)
    lines += ["  map guest_vm {", "    type ifname : verdict"]
    if elements:
        lines.append(f"    elements = {{ {elements} }}")
    lines.append("  }")
    if cfg.protected:
        lines += ["  set protected {", "    type ipv4_addr", "    flags interval"]
        lines.append(f"    elements = {{ {', '.join(cfg.protected)} }}")
        lines.append("  }")

    def chain(name: str, head: str | None, rules: list[str]) -> None:
        lines.append(f"  chain {name} {{")
        if head:
            lines.append(f"    {head}")
        lines.extend(f"    {r}" for r in rules)
        lines.append("  }")

    input_rules = [f"iifname != {wild} accept", *_dns_rules(cfg), _REJECT]
    chain("input", "type filter hook input priority filter; policy accept;", input_rules)
    chain(
        "forward",
        "type filter hook forward priority filter; policy accept;",
        [
            f"oifname {wild} ct state established,related accept",
            f"iifname {wild} oifname {wild} {_REJECT}",
            f"oifname {wild} drop",
            f"iifname != {wild} accept",
            "iifname vmap @guest_vm",
            "drop",
        ],
    )
    chain(
        "postrouting",
        "type nat hook postrouting priority srcnat; policy accept;",
        [f"ip saddr {cfg.subnet} oifname != {wild} masquerade"],
    )
    for a in atts:
        chain(f"vm-{a.slot}", None, vm_chain_rules(cfg, a))
        for name, rules in guard_rules(cfg, a)[1].items():
            chain(name, None, rules)
        for i, layer in enumerate(a.effective_layers()):
            prefix = log_prefix(layer.name, a.namespace, a.name)
            chain(f"vm-{a.slot}-{i}", None, layer_rules(layer, prefix))
    lines.append("}")
    return "\n".join(lines) + "\n"


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
    "guard_rules",
    "layer_rules",
    "log_prefix",
    "merge_ports",
    "render",
    "vm_chain_rules",
]
