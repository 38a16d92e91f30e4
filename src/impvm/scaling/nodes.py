"""Pure decisions about VMs bound to nodes whose agent is gone (like Kubernetes' node lifecycle
controller for pods): an agent renews its Lease every few seconds; when a Lease has not been
renewed for ``lease duration + grace``, its node is lost and its VMs can never progress."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeLease:
    """An agent's Lease: holder (node name), last renewal and duration (seconds)."""

    node: str
    renewed_at: dt.datetime | None
    duration_seconds: int


def lost_nodes(leases: list[NodeLease], now: dt.datetime, grace_seconds: float = 60.0) -> set[str]:
    """Nodes whose every Lease expired more than ``grace_seconds`` ago (never renewed counts as
    expired). A node may have Leases in several namespaces (an agent restarted with another
    ``--lease-namespace``): one live Lease keeps it."""
    expired: dict[str, bool] = {}
    for lease in leases:
        dead = lease.renewed_at is None or (
            (now - lease.renewed_at).total_seconds() > lease.duration_seconds + grace_seconds
        )
        expired[lease.node] = expired.get(lease.node, True) and dead
    return {node for node, dead in expired.items() if dead}


def node_lost(node: str | None, known: set[str], lost: set[str]) -> bool:
    """Whether a VM bound to ``node`` sits on a lost node: its Lease expired, or there is no
    Lease at all for it (the agent never existed or its Lease was deleted)."""
    return bool(node) and (node in lost or node not in known)
