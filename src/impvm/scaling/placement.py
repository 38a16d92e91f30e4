"""Where each unbound ImpVM runs: the operator's placement, as kube-scheduler places pods.

Agents do not pick their own VMs: a node whose agent chose would win every race it liked,
and a compromised node could take every pool's VMs. The operator binds instead (sets
``spec.nodeName``, which the CRD keeps once set), and an agent runs only what is bound to its
node; the API server refuses an agent any write to an unbound VM (deploy/admission/agent.yaml).

The decision (:func:`place`) is pure: from the agents' Leases, every VM the operator sees and
the size of each class, which unbound VMs go to which node. The rules:

- a node is a candidate while its agent's Lease is live (as believed: a renewal dated beyond
  the clock skew or a duration over five minutes is not, :mod:`impvm.scaling.nodes`), its host
  checks passed (``imp.dev/preflight``) and it advertises its capacity (``imp.dev/vcpu``,
  ``imp.dev/memory-mib``);
- a node's use is counted from the VMs bound to it that hold capacity (not yet released by
  their agent, or bound and not yet finished), each at the size it was bound with (annotation
  ``imp.dev/bound-size``; before that, its class's): the operator's own view, current to its
  last write, not the Lease's ``*-used`` values, which are up to one renewal old and written by
  the node;
- a VM goes to the candidate with room for it (both dimensions) that was given the fewest VMs
  lately (``recent``: bindings in the shell's window), then runs the fewest, then by name.
  Neither what a node advertises nor what it reports decides where VMs go, only whether they
  fit: a node that overstates its capacity, or that ends its VMs at once to look empty, gets
  its turn like every other node, not all the VMs (kube-scheduler spreads with
  ``LeastAllocated``; its scores also read what nodes report, which a hostile node controls);
- waiting VMs are taken one per namespace in turn, each namespace oldest first, so a
  namespace with many waiting VMs never holds back another's (fair queuing across tenants);
- a VM whose class is unknown, or that fits on no candidate, stays unbound: the pool's
  ``Unschedulable`` condition says why (:mod:`impvm.scaling.poolpass.lost`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from impvm.api.models import AGENT_FINALIZER
from impvm.api.vm import VM
from impvm.scaling.nodes import NodeLease

__all__ = [
    "Binding",
    "NodeRoom",
    "place",
    "rooms",
    "size_of",
    "uses_capacity",
    "waits_for_node",
]


@dataclass(frozen=True, slots=True)
class Binding:
    """Bind ImpVM ``namespace``/``name`` to ``node`` (``resource_version``: the version it was
    decided on, for logs and tests; the write is not conditional on it, see
    :mod:`impvm.operator.scheduler`)."""

    namespace: str
    name: str
    resource_version: str
    node: str
    #: the size it is bound with (vCPU, MiB): written as annotation ``imp.dev/bound-size``
    size: tuple[int, int] = (0, 0)


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """A candidate node: its free vCPU and MiB, how many VMs it runs and how many it was
    given lately."""

    node: str
    vcpu: int
    memory_mib: int
    vms: int
    recent: int = 0

    def fits(self, vcpu: int, memory_mib: int) -> bool:
        """Whether a VM of ``vcpu`` vCPU and ``memory_mib`` MiB fits."""
        return vcpu <= self.vcpu and memory_mib <= self.memory_mib

    def take(self, vcpu: int, memory_mib: int) -> NodeRoom:
        """The room left after one more VM of that size."""
        return NodeRoom(
            self.node, self.vcpu - vcpu, self.memory_mib - memory_mib, self.vms + 1, self.recent
        )


def uses_capacity(vm: VM) -> bool:
    """Whether a bound VM counts against its node: its agent has not released it (the agent's
    finalizer is on it), or its agent has not taken it yet and it is neither finished nor
    being deleted."""
    if not vm.node_name:
        return False
    return AGENT_FINALIZER in vm.finalizers or not (vm.deleting or vm.is_terminal)


def size_of(vm: VM, sizes: Mapping[str, tuple[int, int]]) -> tuple[int, int] | None:
    """The (vCPU, MiB) a VM counts as: the size it was bound with, else its class's (None:
    neither is known)."""
    return vm.bound_size or sizes.get(vm.class_name)


def rooms(
    leases: Sequence[NodeLease],
    now: dt.datetime,
    vms: Sequence[VM],
    sizes: Mapping[str, tuple[int, int]],
    recent: Mapping[str, int] | None = None,
) -> dict[str, NodeRoom]:
    """The candidate nodes by name with what is free on each. ``sizes``: class name ->
    (vCPU, MiB); a bound VM of no known size counts as size 0 (it was bound before this
    annotation existed and its class is gone: its agent, which admitted it at its size, still
    counts it and refuses what does not fit). ``recent``: node -> VMs bound there lately."""
    recent = recent or {}
    out: dict[str, NodeRoom] = {}
    for le in leases:
        if le.offers(now) and le.vcpu is not None and le.memory_mib is not None:
            out[le.node] = NodeRoom(le.node, le.vcpu, le.memory_mib, 0, recent.get(le.node, 0))
    for vm in vms:
        node = vm.node_name
        if node in out and uses_capacity(vm):
            v, m = size_of(vm, sizes) or (0, 0)
            out[node] = out[node].take(v, m)
    return out


def waits_for_node(vm: VM, sizes: Mapping[str, tuple[int, int]]) -> bool:
    """Whether ``vm`` is one the placement finds a node for: unbound, neither finished nor
    being deleted, readable, of a class of known size."""
    return not (
        vm.node_name
        or vm.deleting
        or vm.is_terminal
        or vm.unreadable is not None
        or vm.class_name not in sizes
    )


def _waiting(vms: Sequence[VM], sizes: Mapping[str, tuple[int, int]]) -> list[VM]:
    """The unbound VMs to place, one per namespace in turn, each namespace oldest first."""
    queues: dict[str, list[VM]] = {}
    for vm in vms:
        if waits_for_node(vm, sizes):
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
    recent: Mapping[str, int] | None = None,
) -> tuple[Binding, ...]:
    """The bindings for the unbound VMs among ``vms`` (see the module docstring for the
    rules). No node is given more than it has free, counting every binding returned.
    ``recent``: node -> VMs bound there within the shell's window."""
    free = rooms(leases, now, vms, sizes, recent)
    out: list[Binding] = []
    for vm in _waiting(vms, sizes):
        v, m = sizes[vm.class_name]  # an unbound VM is placed at its class's size
        fit = [r for r in free.values() if r.fits(v, m)]
        if not fit:
            continue
        best = min(fit, key=lambda r: (r.recent, r.vms, r.node))
        free[best.node] = replace(best.take(v, m), recent=best.recent + 1)
        out.append(Binding(vm.namespace, vm.name, vm.resource_version, best.node, (v, m)))
    return tuple(out)
