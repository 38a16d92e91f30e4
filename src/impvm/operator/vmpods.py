"""The placement through the Kubernetes scheduler (:class:`PodScheduler`): a VM pod per ImpVM,
placed by kube-scheduler; the ImpVM is bound to its pod's node. The decision is
:func:`impvm.scaling.vmpods.plan_vm_pods`, the pods :func:`impvm.operator.manifests.get_vm_pod`;
this module observes and writes.

It replaces :class:`~impvm.operator.scheduler.Scheduler`'s own placement when the operator is
given ``--vm-pods`` (the chart does), and keeps its loop, caches, leader-only writes and
``Scheduled`` Events. VM pods live in the installation's namespace (``--lease-namespace``),
where only the operator may make pods: a tenant, who may make pods in its own namespace, can
never hand the operator a pod that binds its VM to a node of its choosing. A pod the scheduler
cannot place is told to the VM's owners as an Event ``FailedScheduling`` with the scheduler's
message (once per message), since they cannot read the pod.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, cast

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import ConfigMap, Pod

from impvm.api.models import API_VERSION, ClassScheduling
from impvm.api.resources import ImpVMResource
from impvm.api.times import utcnow
from impvm.kube.events import EventRecorder
from impvm.kube.watchcache import WatchCache
from impvm.operator.manifests import get_vm_pod
from impvm.operator.scheduler import Scheduler
from impvm.operator.sources import CachedSource
from impvm.scaling.placement import Binding
from impvm.scaling.settings import VMPodSettings
from impvm.scaling.vmpods import (
    VM_POD_COMPONENT,
    CreatePod,
    DeletePod,
    Unschedulable,
    VMPod,
    plan_vm_pods,
)

__all__ = ["MAX_VM_PODS", "PodScheduler"]

log = logging.getLogger("impvm.operator.vmpods")

#: The most VM pods the placement holds (as the VM caches: MAX_BOUND + MAX_UNBOUND).
MAX_VM_PODS = 70_000
#: VMs whose last FailedScheduling message is remembered (so each is told once).
_TOLD = 10_000


class PodScheduler(Scheduler):
    """Places ImpVMs through VM pods while ``leading()``. ``namespace``: the installation's,
    where the VM pods live; ``grace_seconds``: the node-lost grace."""

    def __init__(
        self,
        kube: AsyncClient,
        sources: CachedSource,
        events: EventRecorder,
        pods: VMPodSettings,
        namespace: str,
        grace_seconds: float,
        namespaces: list[str] | None = None,
        leading: Any = lambda: True,
    ) -> None:
        super().__init__(kube, sources, events, namespaces, leading)
        self.settings, self.namespace, self.grace = pods, namespace, grace_seconds
        self.pods: WatchCache[VMPod] = WatchCache(
            kube,
            Pod,
            VMPod.from_body,
            namespace=namespace,
            labels={"app.kubernetes.io/component": VM_POD_COMPONENT},
            max_objects=MAX_VM_PODS,
            on_change=self._changed,
            name=f"vm pods in {namespace}",
        )
        self._told: OrderedDict[str, str] = OrderedDict()
        #: the uid of the ConfigMap that controls the VM pods (read by :meth:`run`)
        self.owner_uid = ""

    def watches(self) -> list[WatchCache[Any]]:
        return [*self.caches, self.pods]

    async def run(self) -> None:
        """Read the owning ConfigMap, then watch and place until cancelled. Raises ApiError
        when the ConfigMap cannot be read (404: the installation is incomplete): the leader
        exits rather than make pods nothing owns."""
        cm = await self.kube.get(
            ConfigMap, self.settings.owner_config_map, namespace=self.namespace
        )
        self.owner_uid = str(cm.metadata.uid if cm.metadata else "")
        await super().run()

    async def place_once(self) -> int:
        """One pass: decide from the caches, write each action. Returns how many VMs were
        bound."""
        leases = await self.sources.leases()
        actions = plan_vm_pods(
            self.vms(),
            self.pods.values(),
            leases,
            utcnow(),
            self.sources.class_sizes(),
            self.grace,
            self.owner_uid,
        )
        bound = 0
        for a in actions:
            if not self.leading():
                log.warning("not placing ImpVMs: not the leader")
                break
            if isinstance(a, Binding):
                bound += await self._bind(a, " (its VM pod's node)")
                self._told.pop(f"{a.namespace}/{a.name}", None)
            elif isinstance(a, CreatePod):
                await self._create(a)
            elif isinstance(a, DeletePod):
                await self._delete(a)
            elif isinstance(a, Unschedulable):
                await self._tell(a)
        return bound

    async def _create(self, a: CreatePod) -> None:
        scheduling = self._scheduling(a.vm.class_name)
        body = get_vm_pod(a, self.settings, scheduling, self.namespace, self.owner_uid)
        try:
            got = await self.kube.create(cast(Pod, Pod.from_dict(body)))
        except ApiError as e:
            # 409: made before a crash, the last one still going, or a pod the operator did not
            # make holds the name; 403/422: a quota, an admission policy, a class's scheduling
            # the pod API refuses. Told to the VM's owners (once per message); tried each pass.
            why = f"VM pod {body['metadata']['name']} not made: {e.status.message}"[:1000]
            log.warning("ImpVM %s/%s: %s", a.vm.namespace, a.vm.name, why)
            held = self.pods.get((self.namespace, body["metadata"]["name"]))
            ours = held is not None and held.owner_uid == self.owner_uid and not held.mirror
            if e.status.code != 409 or not ours:
                await self._tell(
                    Unschedulable(a.vm.namespace, a.vm.name, a.vm.uid, why), "FailedCreate"
                )
            return
        self.pods.written(got.to_dict())
        log.info(
            "VM pod %s made for ImpVM %s/%s", body["metadata"]["name"], a.vm.namespace, a.vm.name
        )

    async def _delete(self, a: DeletePod) -> None:
        if a.unless_vm is not None and await self._vm_exists(*a.unless_vm):
            return  # a VM the caches leave out (over their caps): its pod stays
        try:
            await self.kube.delete(Pod, a.name, namespace=self.namespace, grace_period=0)
        except ApiError as e:
            if e.status.code != 404:
                raise
        log.info("VM pod %s deleted: %s", a.name, a.reason)

    async def _vm_exists(self, namespace: str, name: str, uid: str) -> bool:
        got = await self.sources.api_get(ImpVMResource, name, namespace)  # not the cache's
        return got is not None and got["metadata"].get("uid") == uid

    async def _tell(self, a: Unschedulable, reason: str = "FailedScheduling") -> None:
        key = f"{a.namespace}/{a.name}"
        if self._told.get(key) == a.message:
            return
        self._told[key] = a.message
        self._told.move_to_end(key)
        while len(self._told) > _TOLD:
            self._told.popitem(last=False)
        await self.events.record(
            api_version=API_VERSION,
            kind="ImpVM",
            namespace=a.namespace,
            name=a.name,
            uid=a.uid,
            reason=reason,
            message=a.message,
            warning=True,
        )

    def _scheduling(self, class_name: str) -> ClassScheduling | None:
        """The class's ``spec.scheduling`` (None: none, or the class is not readable)."""
        raw = self.sources.class_spec(class_name)
        if not raw or not isinstance(raw.get("scheduling"), dict):
            return None
        try:
            return ClassScheduling.model_validate(raw["scheduling"])
        except ValueError:
            return None
