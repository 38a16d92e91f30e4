"""Where each unbound ImpVM runs: the operator's placement, as kube-scheduler places pods.

Agents do not pick their own VMs: a node whose agent chose would win every race it liked,
and a compromised node could take every pool's VMs. The operator binds instead (sets
``spec.nodeName``, which the CRD keeps once set), and an agent runs only what is bound to its
node; the API server refuses an agent any write to an unbound VM (deploy/admission/agent.yaml).

The decision (:func:`place`) is pure: from the agents' Leases, every VM the operator sees and
the size of each class, which unbound VMs go to which node. The rules:

- a node is a candidate while its agent's Lease is live, its host checks passed
  (``imp.dev/preflight``) and it advertises its capacity (``imp.dev/vcpu``,
  ``imp.dev/memory-mib``);
- a node's use is counted from the VMs bound to it that hold capacity (not yet released by
  their agent, or bound and not yet finished): the operator's own view, current to its last
  write, not the Lease's ``*-used`` values, which are up to one renewal old;
- a VM goes to the candidate with room for its class (both dimensions) that runs the fewest
  VMs, then the most free memory, then by name (kube-scheduler's ``LeastAllocated`` spreads
  the same way); a node that overstates its capacity gets its share of VMs, not all of them;
- waiting VMs are taken one per namespace in turn, each namespace oldest first, so a
  namespace with many waiting VMs never holds back another's (fair queuing across tenants);
- a VM whose class is unknown, or that fits on no candidate, stays unbound: the pool's
  ``Unschedulable`` condition says why (:mod:`impvm.scaling.poolpass.lost`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from impvm.api.models import AGENT_FINALIZER
from impvm.api.vm import VM
from impvm.scaling.nodes import NodeLease

__all__ = ["Binding", "NodeRoom", "place", "rooms", "uses_capacity"]


@dataclass(frozen=True, slots=True)
class Binding:
    """Bind ImpVM ``namespace``/``name`` to ``node``, if it still has ``resource_version``."""

    namespace: str
    name: str
    resource_version: str
    node: str


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """A candidate node: its free vCPU and MiB and how many VMs it runs."""

    node: str
    vcpu: int
    memory_mib: int
    vms: int

    def fits(self, vcpu: int, memory_mib: int) -> bool:
        """Whether a VM of ``vcpu`` vCPU and ``memory_mib`` MiB fits."""
        return vcpu <= self.vcpu and memory_mib <= self.memory_mib

    def take(self, vcpu: int, memory_mib: int) -> NodeRoom:
        """The room left after one more VM of that size."""
        return NodeRoom(self.node, self.vcpu - vcpu, self.memory_mib - memory_mib, self.vms + 1)


def uses_capacity(vm: VM) -> bool:
    """Whether a bound VM counts against its node: its agent has not released it (the agent's
    finalizer is on it), or its agent has not taken it yet and it is neither finished nor
    being deleted."""
    if not vm.node_name:
        return False
    return AGENT_FINALIZER in vm.finalizers or not (vm.deleting or vm.is_terminal)


def rooms(
    leases: Sequence[NodeLease],
    now: dt.datetime,
    vms: Sequence[VM],
    sizes: Mapping[str, tuple[int, int]],
) -> dict[str, NodeRoom]:
    """The candidate nodes by name with what is free on each. ``sizes``: class name ->
    (vCPU, MiB); a bound VM of an unknown class counts as a VM of size 0."""
    offered: dict[str, tuple[int, int]] = {}
    for le in leases:
        if le.live(now) and le.preflight_ok and le.vcpu is not None and le.memory_mib is not None:
            offered[le.node] = (le.vcpu, le.memory_mib)
    out = {node: NodeRoom(node, v, m, 0) for node, (v, m) in offered.items()}
    for vm in vms:
        node = vm.node_name
        if node in out and uses_capacity(vm):
            v, m = sizes.get(vm.class_name, (0, 0))
            out[node] = out[node].take(v, m)
    return out


def _waiting(vms: Sequence[VM], sizes: Mapping[str, tuple[int, int]]) -> list[VM]:
    """The unbound VMs to place, one per namespace in turn, each namespace oldest first."""
    queues: dict[str, list[VM]] = {}
    for vm in vms:
        if vm.node_name or vm.deleting or vm.is_terminal or vm.unreadable is not None:
            continue
        if vm.class_name not in sizes:
            continue
        queues.setdefault(vm.namespace, []).append(vm)
    ranked: list[tuple[int, dt.datetime, str, str, VM]] = []
    for queue in queues.values():
        queue.sort(key=lambda v: (v.created_at, v.name))
        ranked += [(i, v.created_at, v.namespace, v.name, v) for i, v in enumerate(queue)]
    ranked.sort(key=lambda r: r[:4])
    return [r[4] for r in ranked]


def place(
    leases: Sequence[NodeLease],
    now: dt.datetime,
    vms: Sequence[VM],
    sizes: Mapping[str, tuple[int, int]],
) -> tuple[Binding, ...]:
    """The bindings for the unbound VMs among ``vms`` (see the module docstring for the
    rules). No node is given more than it has free, counting every binding returned."""
    free = rooms(leases, now, vms, sizes)
    out: list[Binding] = []
    for vm in _waiting(vms, sizes):
        v, m = sizes[vm.class_name]
        fit = [r for r in free.values() if r.fits(v, m)]
        if not fit:
            continue
        best = min(fit, key=lambda r: (r.vms, -r.memory_mib, r.node))
        free[best.node] = best.take(v, m)
        out.append(Binding(vm.namespace, vm.name, vm.resource_version, best.node))
    return tuple(out)
