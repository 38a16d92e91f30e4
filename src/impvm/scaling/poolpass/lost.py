"""VMs and nodes: lost nodes (like Kubernetes' node lifecycle controller: a VM on a node whose
agent Lease expired is marked ``Failed``/``NodeLost``; one being deleted has the agent finalizer
released) and placement (condition ``Unschedulable`` while VMs fit on no live agent, like the
scheduler's ``FailedScheduling``) and acceleration (condition ``Emulated`` while VMs run under
TCG). Pure: :mod:`impvm.scaling.nodes` judges the Leases."""

from __future__ import annotations

from impvm.api.conditions import ConditionSet
from impvm.api.models import AGENT_FINALIZER, ImpVMStatus, VMPhase
from impvm.api.patches import whole_seconds
from impvm.scaling.nodes import lost_nodes, node_lost, unschedulable
from impvm.scaling.poolpass.acts import EventSpec, PatchVMStatus, ReleaseFinalizer
from impvm.scaling.poolpass.world import PoolWorld

__all__ = [
    "UNSCHEDULABLE_AFTER_SECONDS",
    "lost_vms",
    "placement",
    "unschedulable_due",
    "waiting_for_a_node",
]

#: an unbound VM younger than this is not yet judged unschedulable: the operator binds within a
#: second (:mod:`impvm.scaling.placement`), and the used capacity on the Leases this condition
#: quotes is up to one renewal (10 s) old
UNSCHEDULABLE_AFTER_SECONDS = 15.0


def lost_vms(
    world: PoolWorld,
) -> tuple[tuple[ReleaseFinalizer, ...], tuple[PatchVMStatus, ...]]:
    """Finalizer releases and ``Failed``/``NodeLost`` status patches for the VMs bound to lost
    nodes (``node_lost_grace_seconds`` past their Lease's expiry, or no Lease at all)."""
    bound = [vm for vm in world.vms if vm.node_name]
    if not bound:
        return (), ()
    leases = list(world.leases)
    lost = lost_nodes(leases, world.now, world.settings.node_lost_grace_seconds)
    known = {lease.node for lease in leases}
    releases: list[ReleaseFinalizer] = []
    patches: list[PatchVMStatus] = []
    for vm in bound:
        node = vm.node_name
        if not node_lost(node, known, lost):
            continue
        if vm.deleting:
            if AGENT_FINALIZER in vm.finalizers:
                releases.append(
                    ReleaseFinalizer(
                        name=vm.name,
                        resource_version=vm.resource_version,
                        finalizers=tuple(f for f in vm.finalizers if f != AGENT_FINALIZER),
                        event=EventSpec("NodeLost", f"{vm.name}: node {node} lost; VM released"),
                    )
                )
        elif not vm.is_terminal:
            status = ImpVMStatus(
                phase=VMPhase.FAILED,
                exit_reason="NodeLost",
                finished_at=whole_seconds(world.now),
                message=f"the agent of node {node} stopped renewing its Lease",
            )
            event = EventSpec("NodeLost", f"{vm.name}: node {node} lost", warning=True)
            patches.append(PatchVMStatus(name=vm.name, status=status, event=event))
    return tuple(releases), tuple(patches)


def _unbound_ages(world: PoolWorld) -> list[float]:
    """Seconds since creation of each live VM bound to no node."""
    unbound = (None, VMPhase.PENDING)
    return [
        (world.now - v.created_at).total_seconds()
        for v in world.vms
        if not v.spec.node_name and not v.deleting and v.status.phase in unbound
    ]


def unschedulable_due(world: PoolWorld) -> float | None:
    """Seconds until the next VM no node took becomes :data:`UNSCHEDULABLE_AFTER_SECONDS`
    old (None: no such VM)."""
    waiting = [UNSCHEDULABLE_AFTER_SECONDS - a for a in _unbound_ages(world)]
    due = [d for d in waiting if d > 0]
    return max(0.1, min(due)) if due else None


def waiting_for_a_node(world: PoolWorld) -> int:
    """The pool's VMs bound to no node for :data:`UNSCHEDULABLE_AFTER_SECONDS`."""
    return sum(1 for a in _unbound_ages(world) if a >= UNSCHEDULABLE_AFTER_SECONDS)


def placement(world: PoolWorld, conds: ConditionSet, events: list[EventSpec]) -> None:
    """Condition ``Unschedulable``: True (with free and needed vCPU and MiB) while VMs of the
    pool fit on no live agent, with a Warning Event when it becomes True."""
    cls = world.vm_class
    if cls is None:
        return
    waiting = waiting_for_a_node(world)
    verdict = unschedulable(
        list(world.leases), world.now, waiting, cls.spec.vcpu, cls.spec.memory_mib
    )
    if verdict is None:
        text = f"{waiting} VM(s) waiting for a node" if waiting else "every VM is on a node"
        conds.set("Unschedulable", False, "Schedulable", text, world.now)
        return
    if conds.set("Unschedulable", True, verdict.reason, verdict.message, world.now):
        events.append(EventSpec("Unschedulable", verdict.message, warning=True))


def acceleration(world: PoolWorld, conds: ConditionSet, events: list[EventSpec]) -> None:
    """Condition ``Emulated``: True while the pool's VMs run under QEMU's TCG emulation (no
    usable ``/dev/kvm`` on their node: many times slower than KVM), with a Warning Event when
    it becomes True. Judged on the live agents running the pool's VMs, else (no VM on a node)
    on every live agent offering room; agents of the process runtime (no QEMU) are left out,
    and with none left the condition stays as it was."""
    live = [le for le in world.leases if le.offers(world.now) and le.emulated is not None]
    used = {vm.node_name for vm in world.vms if vm.node_name}
    judged = [le for le in live if le.node in used] or live
    if not judged:
        return
    emulated = sorted({le.node for le in judged if le.emulated})
    if not emulated:
        conds.set("Emulated", False, "KVM", "VMs run under KVM", world.now)
        return
    text = (
        "VMs run under TCG emulation, many times slower than KVM (no usable /dev/kvm; the "
        f"agent's preflight says why, `impvm status`): on {', '.join(emulated)}"
    )[:1000]
    if conds.set("Emulated", True, "NoKVM", text, world.now):
        events.append(EventSpec("Emulated", text, warning=True))
