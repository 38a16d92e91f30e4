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
    """Nodes whose Lease expired more than ``grace_seconds`` ago (never renewed counts as
    expired)."""
    out = set()
    for lease in leases:
        if lease.renewed_at is None:
            out.add(lease.node)
            continue
        age = (now - lease.renewed_at).total_seconds()
        if age > lease.duration_seconds + grace_seconds:
            out.add(lease.node)
    return out


def node_lost(node: str | None, known: set[str], lost: set[str]) -> bool:
    """Whether a VM bound to ``node`` sits on a lost node: its Lease expired, or there is no
    Lease at all for it (the agent never existed or its Lease was deleted)."""
    return bool(node) and (node in lost or node not in known)
