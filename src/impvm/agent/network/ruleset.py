"""The nftables ruleset for the VMs attached on this node, as pure functions (the address plan
it is built on, slots and interface names: :mod:`impvm.agent.network.plan`).

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

from collections.abc import Iterable, Sequence

from impvm.agent.network.plan import Attachment, NetConfig
from impvm.agent.network.policy import (
    BLOCKED_RANGES,
    Allow,
    EgressLayer,
    PortRange,
    explicit_entries,
)

#: nf_log's prefix limit (NF_LOG_PREFIXLEN, 128 bytes with the terminating NUL).
LOG_PREFIX_MAX = 127
_REJECT = "reject with icmpx type admin-prohibited"
_LIMIT = "limit rate 20/second burst 40 packets"


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


__all__ = [
    "guard_rules",
    "layer_rules",
    "log_prefix",
    "merge_ports",
    "render",
    "vm_chain_rules",
]
