"""What the agent asks its runtime for one VM: the size the VM runs at and its
:class:`~impvm.agent.runtime.VMRequest` (image, runner layer, size, disk, work directory, egress
policy, the key its signatures are checked with), rebuilt at every decision from the VM and its
class."""

from __future__ import annotations

from pathlib import Path

from impvm.agent.capacity import ZERO, Resources
from impvm.agent.network.policy import EgressLayer, egress_layers
from impvm.agent.runtime import VMRequest
from impvm.api.models import ImpVMClassSpec
from impvm.api.vm import VM


def vm_size(vm: VM, spec: ImpVMClassSpec | None) -> Resources | None:
    """The size a VM runs at: the one the operator bound it with (annotation
    ``imp.dev/bound-size``), else its class's; None while its class is missing (a VM is never
    started without its class, whose network policy it needs)."""
    if spec is None:
        return None
    bound = vm.bound_size
    return Resources(*bound) if bound is not None else Resources(spec.vcpu, spec.memory_mib)


def vm_request(
    vm: VM, spec: ImpVMClassSpec | None, size: Resources | None, workdir: Path
) -> VMRequest:
    """The runtime request of a VM bound here (``workdir``: its private directory), rebuilt at
    every decision from the class cache (its size and egress policy). Without its class only
    stop and cleanup use it (``decide`` starts no VM whose class is missing)."""
    return request_for(
        vm.vm_id,
        vm.namespace,
        vm.name,
        size or ZERO,
        vm,
        workdir,
        disk_gib=spec.disk_gib if spec is not None else 1,
        egress=egress_layers(spec.network if spec else None, vm.spec.network),
    )


def request_for(
    vm_id: str,
    namespace: str,
    name: str,
    size: Resources,
    vm: VM | None,
    workdir: Path,
    disk_gib: int = 1,
    egress: tuple[EgressLayer, ...] = (),
) -> VMRequest:
    """A runtime request; ``vm`` gives image and runner layer (none for a stale workdir);
    ``egress``: its network's policy layers (:func:`egress_layers`)."""
    spec = vm.spec if vm is not None else None
    return VMRequest(
        vm_id=vm_id,
        name=name,
        namespace=namespace,
        image=spec.image if spec else "",
        runner_layer=spec.runner_layer if spec else None,
        allow_unpinned_images=bool(spec.allow_unpinned_images) if spec else False,
        vcpu=size.vcpu,
        memory_mib=size.memory_mib,
        disk_gib=disk_gib,
        workdir=workdir,
        egress=egress,
        verify_public_key=spec.verify.public_key if spec and spec.verify else None,
    )
