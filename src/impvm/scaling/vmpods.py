"""Placement through the Kubernetes scheduler: a VM pod per ImpVM. Pure.

On a Kubernetes cluster (the chart's ``vmPods``, on by default) the operator does not pick
nodes itself. Each ImpVM that holds or will hold a node's resources gets a *VM pod* in the
installation's namespace: a pod that runs nothing (``sleep``) and requests the VM's vCPU and
memory (plus QEMU's overhead). kube-scheduler places it like any pod, so node affinity, taints,
priorities and preemption apply to VMs, other pods cannot overcommit a VM host, and a VM that
fits on no node leaves a Pending pod a cluster autoscaler acts on. The operator then binds the
ImpVM to the node its pod was scheduled to. KubeVirt's virt-launcher (a pod per VM that holds
its resources) is the model; the VM's process itself stays with the node's agent.

The decision (:func:`plan_vm_pods`) is from the VMs the operator sees, the VM pods and the
agents' Leases. A VM pod is a pod the operator made: controlled by its ConfigMap, named
``vm-<ImpVM uid>``, no mirror pod. A pod a kubelet made (NodeRestriction lets a node make
mirror pods only, bound to itself, in any namespace, with any name and labels) or anyone else
made is never taken for one, so no node can bind a VM to itself by making its pod first.

- a VM that is waiting (unbound, not finished, of a known class) or holds its node's
  resources (:func:`impvm.scaling.placement.uses_capacity`) and has no pod gets one
  (:class:`CreatePod`): unbound, placed by the scheduler away from nodes whose agent is lost or
  failed its host checks; bound (made by hand with ``spec.nodeName``, or bound before VM pods
  were on), pinned to its node so that node's use is counted;
- a waiting VM whose pod the scheduler bound to a node whose agent is live and passed its host
  checks is bound there (:class:`~impvm.scaling.placement.Binding`, at the size its pod
  requested, the one the scheduler counted) once
  that agent's advertised capacity has room for it (counted as
  :func:`impvm.scaling.placement.rooms` does, with this pass's bindings): the scheduler counts
  the node's allocatable resources, the agent may offer less (``--vcpu``, ``--memory-mib``),
  and a VM bound beyond it would only fail ``OutOfCapacity``; a pod that waited so for longer
  than the node-lost grace is remade, for the scheduler to choose again;
- a waiting VM's pod on a node whose agent is lost or failed its checks, or on a node with no
  agent Lease for longer than the node-lost grace, or that ended (the kubelet refused it,
  e.g. ``OutOfcpu``), is deleted (:class:`DeletePod`) and made again next pass;
- the pod of a VM that ended, is being deleted or is no longer seen is deleted;
- a waiting VM whose pod the scheduler could not place is reported
  (:class:`Unschedulable`: the scheduler's own message, e.g. "0/2 nodes are available:
  2 Insufficient cpu.").
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from impvm.api.times import parse_time
from impvm.api.vm import VM, parse_size
from impvm.scaling.nodes import NodeLease, lost_nodes
from impvm.scaling.placement import (
    Binding,
    NodeRoom,
    rooms,
    size_of,
    uses_capacity,
    waits_for_node,
)

__all__ = [
    "MAX_AVOIDED_NODES",
    "MIRROR_ANNOTATION",
    "VM_POD_COMPONENT",
    "VM_POD_SIZE_ANNOTATION",
    "VM_POD_UID_LABEL",
    "VM_POD_VM_ANNOTATION",
    "CreatePod",
    "DeletePod",
    "PodAction",
    "Unschedulable",
    "VMPod",
    "plan_vm_pods",
    "vm_pod_name",
]

#: Label on a VM pod: the uid of its ImpVM.
VM_POD_UID_LABEL = "imp.dev/vm-uid"
#: Annotation on a VM pod: "<namespace>/<name>" of its ImpVM (for people; the uid decides).
VM_POD_VM_ANNOTATION = "imp.dev/vm"
#: The ``app.kubernetes.io/component`` of VM pods.
VM_POD_COMPONENT = "vm"
#: The most nodes a VM pod is kept away from (a longer list says the cluster has bigger trouble).
MAX_AVOIDED_NODES = 64


#: Annotation on a VM pod: the size "<vCPU>,<MiB>" it requests, which its VM is bound at.
VM_POD_SIZE_ANNOTATION = "imp.dev/vm-size"
#: The annotation every pod a kubelet makes carries (NodeRestriction lets a node make no other).
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def vm_pod_name(vm_uid: str) -> str:
    """The VM pod's name: fixed by its ImpVM's uid, so a pod made before a crash is found again
    (AlreadyExists), never made twice."""
    return f"vm-{vm_uid}"


@dataclass(frozen=True, slots=True)
class VMPod:
    """A VM pod as the operator reads it: its ImpVM's uid, the node it was scheduled to, its
    phase, when it was scheduled, the scheduler's message while it cannot be placed."""

    name: str
    vm_uid: str
    node_name: str | None = None
    phase: str = "Pending"
    scheduled_at: dt.datetime | None = None
    unschedulable: str | None = None
    deleting: bool = False
    #: the uid of its controller (the operator's VM pods: the ConfigMap they are made from)
    owner_uid: str = ""
    #: a mirror pod (``kubernetes.io/config.mirror``): made by a kubelet, never by the operator
    mirror: bool = False
    #: the size (vCPU, MiB) it requests for its VM (annotation ``imp.dev/vm-size``)
    size: tuple[int, int] | None = None
    #: its VM's (namespace, name, uid), from the annotation ``imp.dev/vm`` and its uid label
    vm: tuple[str, str, str] | None = None

    @classmethod
    def from_body(cls, raw: Mapping[str, Any]) -> VMPod:
        """From a Pod's wire form (anything missing or malformed reads as absent)."""
        meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
        status = raw.get("status") or {}
        scheduled_at, unschedulable = None, None
        for c in status.get("conditions") or []:
            if not isinstance(c, Mapping) or c.get("type") != "PodScheduled":
                continue
            if c.get("status") == "True":
                scheduled_at = parse_time(c.get("lastTransitionTime"))
            elif c.get("reason") == "Unschedulable":
                unschedulable = str(c.get("message") or "unschedulable")[:1000]
        owner = next(
            (
                str(o.get("uid") or "")
                for o in meta.get("ownerReferences") or []
                if isinstance(o, Mapping) and o.get("controller") and o.get("kind") == "ConfigMap"
            ),
            "",
        )
        annotations = meta.get("annotations") or {}
        vm_uid = str((meta.get("labels") or {}).get(VM_POD_UID_LABEL) or "")
        ns, _, vm_name = str(annotations.get(VM_POD_VM_ANNOTATION) or "").partition("/")
        return cls(
            vm=(ns, vm_name, vm_uid) if ns and vm_name and vm_uid else None,
            owner_uid=owner,
            mirror=MIRROR_ANNOTATION in annotations,
            size=parse_size(annotations.get(VM_POD_SIZE_ANNOTATION)),
            name=str(meta.get("name") or ""),
            vm_uid=vm_uid,
            node_name=spec.get("nodeName") or None,
            phase=str(status.get("phase") or "Pending"),
            scheduled_at=scheduled_at,
            unschedulable=unschedulable,
            deleting=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True, slots=True)
class CreatePod:
    """Make the VM pod of ``vm`` at ``size`` (vCPU, MiB): on ``node`` when the VM is bound,
    else for the scheduler, kept away from ``avoid``."""

    vm: VM
    size: tuple[int, int]
    node: str | None = None
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeletePod:
    """Delete VM pod ``name`` (``reason``: for the log). ``unless_vm``: (namespace, name, uid)
    of a VM the caches did not show: the shell deletes only once the API server confirms that
    VM is gone (a namespace over the caches' caps leaves VMs out of them)."""

    name: str
    reason: str
    unless_vm: tuple[str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """The scheduler cannot place the pod of VM ``namespace``/``name``: ``message`` is its
    own (recorded once per message as an Event on the VM)."""

    namespace: str
    name: str
    uid: str
    message: str


PodAction = CreatePod | DeletePod | Binding | Unschedulable


def _age(since: dt.datetime | None, now: dt.datetime) -> float:
    return 0.0 if since is None else (now - since).total_seconds()


def plan_vm_pods(
    vms: Sequence[VM],
    pods: Sequence[VMPod],
    leases: Sequence[NodeLease],
    now: dt.datetime,
    sizes: Mapping[str, tuple[int, int]],
    grace_seconds: float,
    owner_uid: str,
) -> tuple[PodAction, ...]:
    """What to do about VM pods (see the module docstring for the rules). ``sizes``: class name
    -> (vCPU, MiB); ``grace_seconds``: the node-lost grace (a pod on a node with no agent Lease
    waits that long for one); ``owner_uid``: the uid of the ConfigMap the operator's VM pods
    are controlled by. A pod is a VM pod only when that ConfigMap controls it, it is named for
    its VM and it is no mirror pod: any other pod, a node's mirror pod with the right name and
    labels included, binds nothing and is left alone. Each VM gets at most one action, each
    pod at most one."""
    lost = lost_nodes(list(leases), now, grace_seconds)
    failed = {le.node for le in leases if not le.preflight_ok}
    live = {le.node for le in leases if le.preflight_ok and le.live(now)}
    leased = {le.node for le in leases}
    avoid = _avoided(leases, lost | failed)
    free = rooms(leases, now, vms, sizes)
    pods = [
        p
        for p in pods
        if owner_uid
        and p.owner_uid == owner_uid
        and not p.mirror
        and p.vm_uid
        and p.name == vm_pod_name(p.vm_uid)
    ]
    pods_by_uid = {p.vm_uid: p for p in pods}
    out: list[PodAction] = []
    seen: set[str] = set()
    for vm in vms:
        if not vm.uid:
            continue
        seen.add(vm.uid)
        pod = pods_by_uid.get(vm.uid)
        waiting = waits_for_node(vm, sizes)
        if not waiting and not uses_capacity(vm):
            if pod is not None and not pod.deleting:
                out.append(DeletePod(pod.name, f"ImpVM {vm.namespace}/{vm.name} ended"))
            continue
        if pod is None:
            size = sizes[vm.class_name] if waiting else (size_of(vm, sizes) or (0, 0))
            out.append(CreatePod(vm, size, vm.node_name, avoid if waiting else ()))
            continue
        if pod.deleting:
            continue
        if not waiting:
            if pod.node_name and pod.node_name != vm.node_name:
                out.append(DeletePod(pod.name, f"on {pod.node_name}, its VM on {vm.node_name}"))
            continue
        out += _for_waiting(vm, pod, sizes, now, grace_seconds, live, lost | failed, leased, free)
    for pod in pods:
        if pod.vm_uid not in seen and not pod.deleting:
            out.append(DeletePod(pod.name, "its ImpVM is gone", pod.vm))
    return tuple(out)


def _avoided(leases: Sequence[NodeLease], bad: set[str]) -> tuple[str, ...]:
    """The bad nodes a new pod is kept from, those renewed last first (a node whose agent just
    died, not one a cluster autoscaler removed long ago, whose Lease nobody deleted)."""
    last: dict[str, dt.datetime] = {}
    for le in leases:
        if le.node in bad and le.renewed_at is not None:
            last[le.node] = max(le.renewed_at, last.get(le.node, le.renewed_at))
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    ranked = sorted(bad, key=lambda n: (last.get(n, epoch), n), reverse=True)
    return tuple(ranked[:MAX_AVOIDED_NODES])


def _for_waiting(
    vm: VM,
    pod: VMPod,
    sizes: Mapping[str, tuple[int, int]],
    now: dt.datetime,
    grace_seconds: float,
    live: set[str],
    bad: set[str],
    leased: set[str],
    free: dict[str, NodeRoom],
) -> list[PodAction]:
    """The action for a waiting VM that has a pod (``free``: each offering node's room, taken
    from as VMs are bound)."""
    if pod.phase in ("Failed", "Succeeded"):
        return [DeletePod(pod.name, f"the kubelet ended it ({pod.phase})")]
    node = pod.node_name
    if node is None:
        if pod.unschedulable:
            return [Unschedulable(vm.namespace, vm.name, vm.uid, pod.unschedulable)]
        return []
    if node in live:
        v, m = pod.size or sizes[vm.class_name]  # the size the scheduler counted
        room = free.get(node)
        if room is None or room.fits(v, m):  # no advertised capacity: its agent decides
            if room is not None:
                free[node] = room.take(v, m)
            return [Binding(vm.namespace, vm.name, vm.resource_version, node, (v, m))]
        if _age(pod.scheduled_at, now) > grace_seconds:
            return [
                DeletePod(pod.name, f"node {node}'s agent had no room for {grace_seconds:.0f} s")
            ]
        return []  # its agent's VMs hold what it offers: wait for one to end
    if node in bad:
        return [DeletePod(pod.name, f"node {node}'s agent is lost or failed its host checks")]
    if node not in leased and _age(pod.scheduled_at, now) > grace_seconds:
        return [DeletePod(pod.name, f"no agent on node {node} after {grace_seconds:.0f} s")]
    return []  # its agent's Lease is late (within the grace) or not there yet: wait
