"""Egress policy of one VM as the node enforces it: pure data, no I/O.

A VM's traffic passes through *layers*, each one :class:`EgressLayer`: the ImpVMClass's
``spec.network.egress`` (or :data:`DEFAULT_LAYER` when the class sets none) and then, when set,
the VM's own ``spec.network.egress`` (copied from its pool). A packet leaves the node only when
every layer lets it through, so a pool (a namespace's object) can narrow what the cluster admin's
class allows but never widen it.

One layer decides a new connection like this:

* an ``allow`` entry that matches (destination in the CIDR and, when ports are listed, protocol
  and port in one of them) lets it through;
* otherwise ``public`` lets through every destination outside :data:`BLOCKED_RANGES`, and
  ``allowlist`` nothing;
* what is not let through is rejected - or, with ``audit``, logged (kernel log, prefix
  ``impvm audit <layer> <namespace>/<vm>: ``) and let through.

Never subject to a policy (see :mod:`impvm.agent.network.ruleset`): a guest never reaches an
address of its node nor another guest, and always reaches the node's configured DNS resolvers.

*Protected* destinations (:func:`names_protected`): the node's addresses as the cluster knows
them and the cluster's own networks (pods, services, its DNS) are reached only through an
``allow`` entry that lies inside them - in every layer. An entry that covers more (``10.0.0.0/8``,
``0.0.0.0/0``) opens the rest of its range, never them: opening the cluster must be said in so
many words, never by a wide entry meant for something else.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from impvm.api.models import EgressPolicy, NetworkSpec

#: IPv4 destinations a ``public`` layer blocks unless an ``allow`` entry opens them: "this
#: network" (RFC 791), private (RFC 1918), CGNAT shared space (RFC 6598), loopback (RFC 1122),
#: link-local with the cloud metadata address 169.254.169.254 (RFC 3927), IETF protocol
#: assignments (RFC 6890), multicast (RFC 5771) and reserved/broadcast (RFC 1112, RFC 919).
#: IPv6 never leaves a guest (no IPv6 egress), so ULA, loopback and link-local IPv6 are
#: unreachable too.
BLOCKED_RANGES: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
)

Protocol = Literal["tcp", "udp"]


@dataclass(frozen=True)
class PortRange:
    """``protocol`` ports ``first``..``last`` (inclusive)."""

    protocol: Protocol
    first: int
    last: int


@dataclass(frozen=True)
class Allow:
    """An allowed destination: an IPv4 network (``cidr``, canonical ``a.b.c.d/n``) and the
    ports on it (empty: every port of every protocol)."""

    cidr: str
    ports: tuple[PortRange, ...] = ()


@dataclass(frozen=True)
class EgressLayer:
    """One policy layer: ``name`` (``class`` or ``vm``, shown in audit log prefixes),
    ``mode`` (``public`` or ``allowlist``), ``allow`` entries and ``audit``."""

    name: str
    mode: Literal["public", "allowlist"] = "public"
    allow: tuple[Allow, ...] = ()
    audit: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for the agent's per-VM network record)."""
        return {
            "name": self.name,
            "mode": self.mode,
            "audit": self.audit,
            "allow": [
                {"cidr": a.cidr, "ports": [[p.protocol, p.first, p.last] for p in a.ports]}
                for a in self.allow
            ],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EgressLayer:
        """Inverse of :meth:`to_json`. Raises ``KeyError``/``ValueError`` on a malformed one."""
        mode = obj["mode"]
        if mode not in ("public", "allowlist"):
            raise ValueError(f"unknown egress mode {mode!r}")
        allow = []
        for a in obj["allow"]:
            ports = []
            for proto, first, last in a["ports"]:
                if proto not in ("tcp", "udp"):
                    raise ValueError(f"unknown protocol {proto!r}")
                ports.append(PortRange(proto, int(first), int(last)))
            allow.append(Allow(_canonical(a["cidr"]), tuple(ports)))
        return cls(str(obj["name"]), mode, tuple(allow), bool(obj["audit"]))


#: The layer of a class that sets no egress policy: public, nothing opened, enforcing.
DEFAULT_LAYER = EgressLayer("class")


def _canonical(cidr: str) -> str:
    """``a.b.c.d/n`` with host bits cleared. Raises ``ValueError`` for anything but IPv4."""
    return str(ipaddress.IPv4Network(cidr, strict=False))


def layer_from_api(name: str, policy: EgressPolicy) -> EgressLayer:
    """The :class:`EgressLayer` of an API ``EgressPolicy`` (``spec.network.egress``). The API
    server validated it already (IPv4 CIDRs, ``endPort >= port``); a CIDR with host bits set is
    made canonical. Raises ``ValueError`` for a CIDR that is not IPv4."""
    allow = tuple(
        Allow(
            _canonical(r.cidr),
            tuple(
                PortRange(
                    "tcp" if p.protocol == "TCP" else "udp",
                    p.port,
                    p.end_port if p.end_port is not None else p.port,
                )
                for p in r.ports
            ),
        )
        for r in policy.allow
    )
    return EgressLayer(name, policy.policy, allow, policy.audit)


def egress_layers(
    class_network: NetworkSpec | None, vm_network: NetworkSpec | None
) -> tuple[EgressLayer, ...]:
    """The layers a VM's traffic passes, in order: the class's egress policy (or
    :data:`DEFAULT_LAYER`), then the VM's own when it sets one."""
    layers = [
        layer_from_api("class", class_network.egress)
        if class_network and class_network.egress
        else DEFAULT_LAYER
    ]
    if vm_network and vm_network.egress:
        layers.append(layer_from_api("vm", vm_network.egress))
    return tuple(layers)


def _port_matches(ports: tuple[PortRange, ...], protocol: str | None, port: int | None) -> bool:
    if not ports:
        return True
    return any(
        p.protocol == protocol and port is not None and p.first <= port <= p.last for p in ports
    )


def layer_verdict(
    layer: EgressLayer, dst: str, protocol: str | None = None, port: int | None = None
) -> Literal["accept", "reject", "log"]:
    """What ``layer`` does with a new connection to ``dst`` (IPv4 address) over ``protocol``
    (``tcp``, ``udp`` or ``None`` for anything else) to ``port``: ``accept``, ``reject``, or
    ``log`` (audit: would reject, logged and let through). The reference semantics the
    generated nftables rules implement (tests compare the two)."""
    addr = ipaddress.IPv4Address(dst)
    for a in layer.allow:
        if addr in ipaddress.IPv4Network(a.cidr) and _port_matches(a.ports, protocol, port):
            return "accept"
    if layer.mode == "public" and not any(addr in ipaddress.IPv4Network(b) for b in BLOCKED_RANGES):
        return "accept"
    return "log" if layer.audit else "reject"


def collapse(cidrs: Iterable[str]) -> tuple[str, ...]:
    """IPv4 networks (``a.b.c.d/n``, or an address for ``/32``) merged where they overlap or
    touch, sorted, canonical. Raises ``ValueError`` for anything but IPv4."""
    nets = [ipaddress.IPv4Network(c, strict=False) for c in cidrs]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))


def explicit_entries(layer: EgressLayer, protected: Sequence[str]) -> tuple[Allow, ...]:
    """The ``allow`` entries of ``layer`` that lie inside one of the ``protected`` networks
    (canonical and collapsed, :func:`collapse`): the only ones that open them."""
    nets = [ipaddress.IPv4Network(p) for p in protected]
    return tuple(
        a for a in layer.allow if any(ipaddress.IPv4Network(a.cidr).subnet_of(n) for n in nets)
    )


def names_protected(
    layers: Sequence[EgressLayer],
    protected: Sequence[str],
    dst: str,
    protocol: str | None = None,
    port: int | None = None,
) -> bool:
    """Whether a new connection to ``dst`` may go on to the policy layers as far as the
    protected networks are concerned: ``dst`` is outside them, or every layer has an explicit
    entry (:func:`explicit_entries`) matching it. Audit does not open them. The reference
    semantics of the rendered guard rules (tests compare the two)."""
    addr = ipaddress.IPv4Address(dst)
    if not any(addr in ipaddress.IPv4Network(p) for p in protected):
        return True
    return all(
        any(
            addr in ipaddress.IPv4Network(a.cidr) and _port_matches(a.ports, protocol, port)
            for a in explicit_entries(layer, protected)
        )
        for layer in layers
    )


__all__ = [
    "BLOCKED_RANGES",
    "DEFAULT_LAYER",
    "Allow",
    "EgressLayer",
    "PortRange",
    "collapse",
    "egress_layers",
    "explicit_entries",
    "layer_from_api",
    "layer_verdict",
    "names_protected",
]
