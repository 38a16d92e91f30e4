"""Per-VM guest networks and their egress policy (see docs/network.md).

* :mod:`impvm.agent.network.policy`: egress layers from the API (class, then VM) and their
  reference semantics;
* :mod:`impvm.agent.network.ruleset`: pure planning: address slots, interface names, the
  nftables table;
* :mod:`impvm.agent.network.node`: :class:`~impvm.agent.network.node.NodeNetwork`, which creates
  the interfaces and applies the table.
"""
