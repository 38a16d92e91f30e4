"""Placement through VM pods (impvm.operator.vmpods) against the real API server, the test
playing kube-scheduler's part (the binding subresource; tests/cluster runs the real one): each
waiting ImpVM gets a pod in the installation's namespace that requests its size, is bound to
the node its pod was scheduled to, a pod scheduled to a node whose agent failed its checks is
remade away from it, the scheduler's refusal reaches the VM's owners, and the pod goes with
its VM."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Binding, ConfigMap, Event, Pod
from lightkube.types import PatchType

from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.kube.events import EventRecorder
from impvm.operator.sources import CachedSource
from impvm.operator.vmpods import PodScheduler
from impvm.scaling.settings import VMPodSettings
from tests.operator.test_scheduler import agent_lease, create_vm, nodes_of, running
from tests.support import until

SETTINGS = VMPodSettings(image="reg/impvm-agent@sha256:" + "1" * 64, overhead_mib=128)


@contextlib.asynccontextmanager
async def pod_placement(akube: AsyncClient, tenant: str, home: str) -> AsyncIterator[PodScheduler]:
    sources = CachedSource(akube, [tenant], lease_namespace=home)
    scheduler = PodScheduler(
        akube,
        sources,
        EventRecorder(akube, component="impvm-operator"),
        SETTINGS,
        home,
        60.0,
        [tenant],
    )
    with contextlib.suppress(ApiError):  # what the chart installs: the VM pods' owner
        await akube.create(ConfigMap(metadata=ObjectMeta(name="impvm-vm-pods", namespace=home)))
    async with running(sources, scheduler):
        yield scheduler


async def vm_pods(akube: AsyncClient, home: str) -> list[dict[str, Any]]:
    return [
        p.to_dict()
        async for p in akube.list(Pod, namespace=home, labels={"app.kubernetes.io/component": "vm"})
        if not p.metadata or not p.metadata.deletionTimestamp
    ]


async def schedule(akube: AsyncClient, home: str, pod: str, node: str) -> None:
    """What kube-scheduler does once it chose a node (the API server answers a Status, which
    lightkube cannot read as a Binding: the binding is made all the same)."""
    with contextlib.suppress(msgspec.ValidationError):
        await akube.create(
            Binding(
                metadata=ObjectMeta(name=pod, namespace=home),
                target=ObjectReference(kind="Node", name=node, apiVersion="v1"),
            ),
            name=pod,
            namespace=home,
        )


async def test_a_vm_is_bound_where_kube_scheduler_put_its_pod_and_its_pod_goes_with_it(
    akube: AsyncClient, namespace: str, other_namespace: str, vm_class: str
) -> None:
    home, tenant = namespace, other_namespace
    await agent_lease(akube, home, "node-a", 4, 8192)
    await agent_lease(akube, home, "node-sick", 4, 8192)
    await akube.patch(
        Lease,
        "impvm-agent-node-sick",
        {"metadata": {"annotations": {"imp.dev/preflight": "failed: no /dev/net/tun"}}},
        namespace=home,
        patch_type=PatchType.MERGE,
    )
    await akube.patch(
        ImpVMClassResource,
        vm_class,
        {"spec": {"scheduling": {"nodeSelector": {"zone": "z1"}}}},
        patch_type=PatchType.MERGE,
    )
    await create_vm(akube, tenant, "job-1", vm_class)
    async with pod_placement(akube, tenant, home):

        async def one_pod() -> bool:
            return len(await vm_pods(akube, home)) == 1

        await until("a VM pod made", one_pod)
        (first,) = await vm_pods(akube, home)
        (c,) = first["spec"]["containers"]
        assert c["resources"]["requests"] == {"cpu": "1", "memory": "1152Mi"}
        assert first["metadata"]["annotations"]["imp.dev/vm"] == f"{tenant}/job-1"
        (term,) = first["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["node-sick"]}
        ]
        # the class's scheduling, read from the operator's class cache
        assert term["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["z1"]}]
        # the VM waits for its pod's node: nothing is bound by the operator itself
        assert (await nodes_of(akube, [tenant]))[(tenant, "job-1")] == ""

        # scheduled to the sick node anyway (the Lease turned bad after the pod was made):
        # the pod is remade, the VM is not bound there
        await schedule(akube, home, first["metadata"]["name"], "node-sick")

        async def remade() -> bool:
            pods = await vm_pods(akube, home)
            return len(pods) == 1 and pods[0]["metadata"]["uid"] != first["metadata"]["uid"]

        await until("the pod on the sick node remade", remade)
        assert (await nodes_of(akube, [tenant]))[(tenant, "job-1")] == ""

        # the scheduler cannot place it: the VM's owners are told why
        (second,) = await vm_pods(akube, home)
        message = "0/2 nodes are available: 2 Insufficient cpu."
        await akube.patch(
            Pod.Status,
            second["metadata"]["name"],
            {
                "status": {
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": message,
                        }
                    ]
                }
            },
            namespace=home,
            patch_type=PatchType.MERGE,
        )

        async def told() -> bool:
            events = [e async for e in akube.list(Event, namespace=tenant)]
            return any(e.reason == "FailedScheduling" and e.message == message for e in events)

        await until("FailedScheduling on the ImpVM", told)

        # scheduled to node-a: bound there
        await schedule(akube, home, second["metadata"]["name"], "node-a")

        async def bound() -> bool:
            return (await nodes_of(akube, [tenant]))[(tenant, "job-1")] == "node-a"

        await until("the VM bound to its pod's node", bound)
        raw = (await akube.get(ImpVMResource, "job-1", namespace=tenant)).to_dict()
        assert raw["metadata"]["annotations"]["imp.dev/bound-size"] == "1,1024"

        # the VM ends: its pod goes
        await akube.patch(
            ImpVMResource.Status,
            "job-1",
            {"status": {"phase": "Succeeded"}},
            namespace=tenant,
            patch_type=PatchType.MERGE,
        )

        async def no_pod() -> bool:
            return not await vm_pods(akube, home)

        await until("the ended VM's pod deleted", no_pod)
    # a tenant's own pod in its namespace never binds anything: only the home namespace counts
    try:
        await akube.get(Pod, second["metadata"]["name"], namespace=tenant)
        raise AssertionError("a VM pod in the tenant namespace")
    except ApiError as e:
        assert e.status.code == 404


async def test_a_pod_made_first_by_someone_else_binds_nothing_and_the_owners_are_told(
    akube: AsyncClient, namespace: str, other_namespace: str, vm_class: str
) -> None:
    """A pod named and labelled as the VM's pod, made before the operator's by someone who may
    make pods in the installation's namespace (a node's kubelet may make such a mirror pod
    there), bound to the node of its choosing: the VM is not bound there, and the VM's owners
    learn why it waits (FailedCreate)."""
    home, tenant = namespace, other_namespace
    await agent_lease(akube, home, "node-evil", 64, 65536)
    await create_vm(akube, tenant, "job-1", vm_class)
    uid = (await akube.get(ImpVMResource, "job-1", namespace=tenant)).to_dict()["metadata"]["uid"]
    forged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"vm-{uid}",
            "namespace": home,
            "labels": {"app.kubernetes.io/component": "vm", "imp.dev/vm-uid": uid},
            "annotations": {"imp.dev/vm": f"{tenant}/job-1"},
        },
        "spec": {"nodeName": "node-evil", "containers": [{"name": "c", "image": "x"}]},
    }
    await akube.create(Pod.from_dict(forged))
    async with pod_placement(akube, tenant, home):

        async def told() -> bool:
            events = [e async for e in akube.list(Event, namespace=tenant)]
            return any(
                e.reason == "FailedCreate" and "not made" in (e.message or "") for e in events
            )

        await until("FailedCreate on the ImpVM", told)
        assert (await nodes_of(akube, [tenant]))[(tenant, "job-1")] == ""
        # the foreign pod is left alone: not the operator's to delete
        got = (await akube.get(Pod, f"vm-{uid}", namespace=home)).to_dict()
        assert got["spec"]["nodeName"] == "node-evil" and not got["metadata"].get(
            "deletionTimestamp"
        )
