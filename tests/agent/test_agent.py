"""The node agent's shell against the real API server with the process runtime (real bubblewrap
sandboxes): a VM whose ImpVMClass is missing is refused by name, the agent reads no VM or class
per tick (the API server's own request counters say so), and it forgets the VMs it is done with."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Secret

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.process import ProcessRuntime
from impvm.api.models import API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.devstack.controlplane import ControlPlane
from tests.runtime_fixtures import Images

pytestmark = [pytest.mark.controlplane]


@pytest.fixture
async def akube(control_plane: ControlPlane) -> AsyncIterator[AsyncClient]:
    client = AsyncClient(
        config=KubeConfig.from_file(str(control_plane.kubeconfig)), field_manager="agent-test"
    )
    yield client
    await client.close()


@pytest.fixture
def vm_class(kube: Client) -> Any:
    """A fresh ImpVMClass name; ``create()`` makes it exist. Deleted afterwards."""

    class Cls:
        name = f"agent-test-{uuid.uuid4().hex[:6]}"

        def create(self) -> None:
            kube.create(
                ImpVMClassResource.from_dict(
                    {
                        "apiVersion": API_VERSION,
                        "kind": "ImpVMClass",
                        "metadata": {"name": self.name},
                        "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1},
                    }
                )
            )

    yield Cls()
    with contextlib.suppress(Exception):
        kube.delete(ImpVMClassResource, Cls.name)


def create_vm(
    kube: Client, ns: str, name: str, cls: str, image: str, layer: str, node: str | None = None
) -> None:
    kube.create(
        Secret(
            metadata=ObjectMeta(name=f"{name}-jit", namespace=ns),
            data={JIT_SECRET_KEY: base64.b64encode(b"jit-not-a-real-one").decode()},
        )
    )
    spec: dict[str, Any] = {
        "classRef": {"name": cls},
        "image": image,
        "runnerLayer": layer,
        "runnerConfigSecret": f"{name}-jit",
    }
    if node:
        spec["nodeName"] = node
    kube.create(
        ImpVMResource.from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ImpVM",
                "metadata": {"name": name, "namespace": ns},
                "spec": spec,
            }
        )
    )


@contextlib.asynccontextmanager
async def running_agent(
    akube: AsyncClient, registry: str, tmp_path: Path, namespace: str, tick: float = 0.2
) -> AsyncIterator[Agent]:
    runtime = ProcessRuntime(ImageStore(tmp_path / "cache", 1 << 30, {registry}))
    agent = Agent(
        akube,
        runtime,
        AgentConfig(
            node_name=f"node-{uuid.uuid4().hex[:6]}",
            capacity=Resources(4, 4096),
            workdir=tmp_path / "agent",
            lease_namespace=namespace,
            tick_seconds=tick,
            stop_grace_seconds=2.0,
        ),
    )
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def vms(akube: AsyncClient, ns: str) -> dict[str, dict[str, Any]]:
    """Every VM of the namespace by name (one LIST: the measurement below counts GETs)."""
    return {o.metadata.name: o.to_dict() async for o in akube.list(ImpVMResource, namespace=ns)}


async def until(what: str, check: Callable[[], Awaitable[bool]], seconds: float = 60) -> None:
    for _ in range(int(seconds * 5)):
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"never: {what}")


def condition(vm: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next(
        (c for c in (vm.get("status") or {}).get("conditions") or [] if c["type"] == type_), None
    )


async def test_vm_of_a_missing_class_is_refused_by_name_until_the_class_exists(
    kube: Client,
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
    images: Images,
    vm_class: Any,
) -> None:
    """No fallback size: neither a free VM nor one created bound to the node is claimed or
    booted while its class is missing; both say which class, with a Warning. Once the class
    exists both run."""
    async with running_agent(akube, images.registry, tmp_path, namespace) as agent:
        node = agent.config.node_name
        create_vm(kube, namespace, "free", vm_class.name, images.base, images.sleep)
        create_vm(kube, namespace, "bound", vm_class.name, images.base, images.sleep, node)

        async def both_refused() -> bool:
            got = await vms(akube, namespace)
            return all(condition(v, "ClassMissing") for v in got.values()) and len(got) == 2

        await until("both VMs refused", both_refused)
        for name, vm in (await vms(akube, namespace)).items():
            cond = condition(vm, "ClassMissing")
            assert cond is not None and cond["status"] == "True", (name, cond)
            assert f"'{vm_class.name}'" in cond["message"]
            assert (vm.get("status") or {}).get("phase") is None, name  # not booted
        assert not (await vms(akube, namespace))["free"]["spec"].get("nodeName")  # not claimed
        assert not (tmp_path / "agent" / "vms").exists() or not any(
            (tmp_path / "agent" / "vms").iterdir()
        )
        events = [e async for e in akube.list(Event, namespace=namespace)]
        refused = {e.involvedObject.name for e in events if e.reason == "ClassNotFound"}
        assert refused == {"free", "bound"}
        assert all(
            vm_class.name in (e.message or "") for e in events if e.reason == "ClassNotFound"
        )
        assert all(e.type == "Warning" for e in events if e.reason == "ClassNotFound")

        vm_class.create()

        async def both_running() -> bool:
            got = await vms(akube, namespace)
            return all((v.get("status") or {}).get("phase") == "Running" for v in got.values())

        await until("both VMs running once the class exists", both_running)
        for vm in (await vms(akube, namespace)).values():
            assert vm["spec"]["nodeName"] == node
            cond = condition(vm, "ClassMissing")
            assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Found")


def _requests(control_plane: ControlPlane) -> dict[tuple[str, str], float]:
    """The API server's ``apiserver_request_total`` by (verb, resource) for imp.dev kinds."""
    pki = control_plane.workdir / "pki"
    tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    text = httpx.get(control_plane.url + "/metrics", verify=tls, timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{") or 'group="imp.dev"' not in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        key = (labels["verb"], labels["resource"] + "/" + labels.get("subresource", ""))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_agent_reads_no_vm_and_no_class_per_tick(
    kube: Client,
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
    images: Images,
    vm_class: Any,
    control_plane: ControlPlane,
) -> None:
    """Two running VMs, a tick of 0.2 s: over 3 s the agent sends the API server no GET and
    no LIST of ImpVMs or ImpVMClasses (its watches tell it everything; it used to GET each VM
    and its class every tick)."""
    vm_class.create()
    async with running_agent(akube, images.registry, tmp_path, namespace, tick=0.2):
        for name in ("a", "b"):
            create_vm(kube, namespace, name, vm_class.name, images.base, images.sleep)

        async def running() -> bool:
            got = await vms(akube, namespace)
            return len(got) == 2 and all(
                (v.get("status") or {}).get("phase") == "Running" for v in got.values()
            )

        await until("both VMs running", running)
        before = _requests(control_plane)
        assert before.get(("LIST", "impvms/"), 0) > 0  # the counters are read (our own LISTs)
        await asyncio.sleep(3)
        after = _requests(control_plane)
    reads = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in after
        if k[0] in ("GET", "LIST") and k[1].split("/")[0] in ("impvms", "impvmclasses")
    }
    assert all(v == 0 for v in reads.values()), reads


async def test_agent_forgets_the_vms_it_is_done_with(
    kube: Client,
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
    images: Images,
    vm_class: Any,
) -> None:
    """Five VMs run (the probe runner exits 3), are reported Failed and deleted: afterwards the
    agent holds no worker and no per-VM state for any of them, and its runtime none either
    (these maps used to grow with every VM the node ever ran)."""
    vm_class.create()
    async with running_agent(akube, images.registry, tmp_path, namespace) as agent:
        names = [f"vm-{i}" for i in range(5)]
        for name in names:
            create_vm(kube, namespace, name, vm_class.name, images.base, images.probe)

        async def all_failed() -> bool:
            got = await vms(akube, namespace)
            return len(got) == 5 and all(
                (v.get("status") or {}).get("exitCode") == 3 and not v["metadata"].get("finalizers")
                for v in got.values()
            )

        await until("all VMs ran, failed and were released", all_failed, 120)
        for name in names:
            kube.delete(ImpVMResource, name, namespace=namespace)

        async def forgotten() -> bool:
            return not await vms(akube, namespace) and not agent.tracked()

        await until("the agent forgot every VM", forgotten)
        assert isinstance(agent.runtime, ProcessRuntime) and agent.runtime.known() == set()
        assert len(agent.mine.store) == 0 and len(agent.unbound.store) == 0
