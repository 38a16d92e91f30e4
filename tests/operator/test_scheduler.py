"""The operator's placement loop (impvm.operator.scheduler) against the real API server: it binds
unbound ImpVMs of every watched namespace to live agents' nodes without giving a node more than
its Lease offers, shares the room between namespaces, binds what waited once capacity is freed
or a node appears, and binds nothing while it is not the leader."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from impvm.api.models import AGENT_FINALIZER, API_VERSION
from impvm.api.resources import ImpVMResource
from impvm.kube.events import EventRecorder
from impvm.operator.scheduler import Scheduler
from impvm.operator.sources import CachedSource
from tests.support import until

pytestmark = [pytest.mark.controlplane]


async def agent_lease(akube: AsyncClient, ns: str, node: str, vcpu: int, mib: int) -> None:
    """The Lease an agent of ``node`` keeps (capacity offered, none used)."""
    await akube.apply(
        Lease(
            metadata=ObjectMeta(
                name=f"impvm-agent-{node}",
                namespace=ns,
                labels={"app.kubernetes.io/name": "impvm-agent"},
                annotations={
                    "imp.dev/vcpu": str(vcpu),
                    "imp.dev/memory-mib": str(mib),
                    "imp.dev/preflight": "ok",
                },
            ),
            spec=LeaseSpec(
                holderIdentity=node, leaseDurationSeconds=600, renewTime=dt.datetime.now(dt.UTC)
            ),
        ),
        field_manager="impvm-agent",
        force=True,
    )


async def create_vm(akube: AsyncClient, ns: str, name: str, cls: str) -> None:
    body = {
        "apiVersion": API_VERSION,
        "kind": "ImpVM",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"classRef": {"name": cls}, "image": "reg/base@sha256:" + "0" * 64},
    }
    await akube.create(ImpVMResource.from_dict(body))


async def nodes_of(akube: AsyncClient, namespaces: list[str]) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for ns in namespaces:
        async for vm in akube.list(ImpVMResource, namespace=ns):
            raw: dict[str, Any] = vm.to_dict()
            out[(ns, raw["metadata"]["name"])] = (raw.get("spec") or {}).get("nodeName") or ""
    return out


@contextlib.asynccontextmanager
async def placement(
    akube: AsyncClient, namespaces: list[str], lease_ns: str, leading: Callable[[], bool]
) -> AsyncIterator[Scheduler]:
    sources = CachedSource(akube, namespaces, lease_namespace=lease_ns)
    scheduler = Scheduler(
        akube, sources, EventRecorder(akube, component="impvm-operator"), namespaces, leading
    )
    async with running(sources, scheduler):
        yield scheduler


@contextlib.asynccontextmanager
async def running(sources: CachedSource, scheduler: Scheduler) -> AsyncIterator[None]:
    """``sources`` started and ``scheduler`` placing (woken by Lease changes) for the block;
    both stopped after it."""
    sources.on_lease = scheduler.wake
    await sources.start()
    task = asyncio.create_task(scheduler.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sources.close()


async def test_vms_are_bound_within_the_room_each_lease_offers_and_shared_by_namespaces(
    akube: AsyncClient, namespace: str, other_namespace: str, vm_class: str
) -> None:
    nss = [namespace, other_namespace]
    await agent_lease(akube, namespace, "node-a", 2, 4096)
    await agent_lease(akube, namespace, "node-b", 2, 4096)
    for i in range(6):
        await create_vm(akube, namespace, f"many-{i}", vm_class)
    for i in range(2):
        await create_vm(akube, other_namespace, f"few-{i}", vm_class)
    async with placement(akube, nss, namespace, lambda: True) as scheduler:

        async def four_bound() -> bool:
            return sum(1 for n in (await nodes_of(akube, nss)).values() if n) == 4

        await until("four VMs bound", four_bound)
        await asyncio.sleep(0.5)  # placements that would overcommit would have landed by now
        got = await nodes_of(akube, nss)
        bound = {k: n for k, n in got.items() if n}
        assert sorted(bound.values()) == ["node-a", "node-a", "node-b", "node-b"]
        for ns, name in bound:  # bound at the class's size, which the node counts and starts
            raw = (await akube.get(ImpVMResource, name, namespace=ns)).to_dict()
            assert raw["metadata"]["annotations"]["imp.dev/bound-size"] == "1,1024"
        # one namespace in turn: the two VMs of the quiet namespace are not behind six others
        assert {k for k in bound if k[0] == other_namespace} == {
            (other_namespace, "few-0"),
            (other_namespace, "few-1"),
        }
        events = [e async for e in akube.list(Event, namespace=namespace)]
        scheduled = {e.involvedObject.name for e in events if e.reason == "Scheduled"}
        assert scheduled == {k[1] for k in bound if k[0] == namespace}

        # a VM done on node-a (no finalizer: its agent released it) frees its room
        (done, _) = [k for k, n in bound.items() if n == "node-a"]
        await akube.patch(
            ImpVMResource.Status,
            done[1],
            {"status": {"phase": "Succeeded"}},
            namespace=done[0],
            patch_type=PatchType.MERGE,
        )

        async def five_bound() -> bool:
            return sum(1 for n in (await nodes_of(akube, nss)).values() if n) == 5

        await until("the freed room taken", five_bound)
        # a new node: the last three go there
        await agent_lease(akube, namespace, "node-c", 8, 16384)

        async def all_bound() -> bool:
            return all((await nodes_of(akube, nss)).values())

        await until("every VM bound once a node with room appears", all_bound)
        assert list((await nodes_of(akube, nss)).values()).count("node-c") == 3
        assert all(vm.node_name for vm in scheduler.vms())


async def test_a_vm_of_a_running_agent_counts_and_a_standby_binds_nothing(
    akube: AsyncClient, namespace: str, vm_class: str
) -> None:
    await agent_lease(akube, namespace, "node-full", 1, 1024)
    await create_vm(akube, namespace, "running", vm_class)
    await akube.patch(
        ImpVMResource,
        "running",
        {"metadata": {"finalizers": [AGENT_FINALIZER]}, "spec": {"nodeName": "node-full"}},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )
    await create_vm(akube, namespace, "waiting", vm_class)
    leading = False
    async with placement(akube, [namespace], namespace, lambda: leading) as scheduler:
        await until("the placement sees both VMs", lambda: _has(scheduler, 2))
        assert await scheduler.place_once() == 0  # not the leader
        leading = True
        assert await scheduler.place_once() == 0  # the node is full
        assert (await nodes_of(akube, [namespace]))[(namespace, "waiting")] == ""
        await akube.patch(
            ImpVMResource,
            "running",
            {"metadata": {"finalizers": []}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )
        await akube.delete(ImpVMResource, "running", namespace=namespace)

        async def bound() -> bool:
            return (await nodes_of(akube, [namespace]))[(namespace, "waiting")] == "node-full"

        await until("the waiting VM bound once the node has room", bound)
    # the finalizer was never touched by the placement
    raw = (await akube.get(ImpVMResource, "waiting", namespace=namespace)).to_dict()
    assert not raw["metadata"].get("finalizers")


async def _has(scheduler: Scheduler, n: int) -> bool:
    return len(scheduler.vms()) == n
