"""Per-VM guest networks and their egress policy (see docs/network.md).

* :mod:`impvm.agent.network.policy`: egress layers from the API (class, then VM) and their
  reference semantics;
* :mod:`impvm.agent.network.ruleset`: pure planning: address slots, interface names, the
  nftables table;
* :mod:`impvm.agent.network.node`: :class:`~impvm.agent.network.node.NodeNetwork`, which creates
  the interfaces and applies the table;
* :mod:`impvm.agent.network.cluster`: the node's and the cluster's networks no guest reaches
  unless its policy names them, from the settings, the pod and the API.

The guest network modes (``impvm agent --guest-network``, ``impvm up``'s
``agent.guestNetwork``) are named here, with the warning the unisolated one carries wherever it
runs (agent log, the preflight annotation on the agent's Lease, ``impvm status``, ``impvm up``'s
start).
"""

#: each VM its own network, NAT and egress policy (docs/network.md)
ISOLATED = "isolated"
#: no network of its own: process sandboxes share the agent's network, QEMU guests get
#: user-mode networking; nothing between a guest and this host (development only). The name
#: says what it removes.
UNISOLATED = "unisolated"
GUEST_NETWORK_MODES = (ISOLATED, UNISOLATED)
#: what every place that shows the unisolated mode says (after naming it)
UNISOLATED_WARNING = (
    "VMs share this host's network and reach every service on it, and each other "
    "(development only; set isolated)"
)


def guest_network_error(mode: str, where: str) -> str | None:
    """``None`` for a known mode, else the one-line error naming ``where`` (the option or
    field). ``host`` is the old name of ``unisolated``: the error says so."""
    if mode in GUEST_NETWORK_MODES:
        return None
    hint = ""
    if mode == "host":
        hint = " (renamed: 'host' is now 'unisolated', which isolates nothing)"
    return f"{where} {mode!r}: want {ISOLATED} or {UNISOLATED}{hint}"
