"""The node agent's shell against the real API server with the process runtime (real bubblewrap
sandboxes): a VM whose ImpVMClass is missing is refused by name, the agent reads no VM or class
per tick (the API server's own request counters say so), and it forgets the VMs it is done with."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from lightkube import AsyncClient, Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Secret

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.jitsource import SecretJitSource
from impvm.agent.lifecycle import Preflight
from impvm.agent.process import ProcessRuntime
from impvm.api.models import API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.kube.controlplane import ControlPlane
from tests.runtime_fixtures import Images
from tests.support import until

pytestmark = [pytest.mark.controlplane]


@dataclass
class Env:
    """One test's world: clients, a fresh namespace and ImpVMClass name, the test images."""

    kube: Client
    akube: AsyncClient
    namespace: str
    tmp_path: Path
    images: Images
    cls: str = field(default_factory=lambda: f"agent-test-{uuid.uuid4().hex[:6]}")
    #: the node of the agent last started (VMs are created bound to it)
    node: str = ""

    def create_class(self) -> None:
        self.kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVMClass",
                    "metadata": {"name": self.cls},
                    "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1},
                }
            )
        )

    def create_vm(
        self, name: str, layer: str, node: str | None = None, image: str | None = None
    ) -> None:
        """A VM of the class with a JIT Secret (the runner layers here never use it), of the
        test base image unless ``image`` is given, bound to ``node`` (default: the node of the
        agent last started, as the operator's placement would; ``""``: unbound)."""
        node = self.node if node is None else node
        self.kube.create(
            Secret(
                metadata=ObjectMeta(name=f"{name}-jit", namespace=self.namespace),
                data={JIT_SECRET_KEY: base64.b64encode(b"jit-not-a-real-one").decode()},
            )
        )
        spec: dict[str, Any] = {
            "classRef": {"name": self.cls},
            "image": image or self.images.base,
            "runnerLayer": layer,
            "runnerConfigSecret": f"{name}-jit",
        }
        if node:
            spec["nodeName"] = node
        self.kube.create(
            ImpVMResource.from_dict(
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVM",
                    "metadata": {"name": name, "namespace": self.namespace},
                    "spec": spec,
                }
            )
        )

    async def vms(self) -> dict[str, dict[str, Any]]:
        """Every VM of the namespace by name (one LIST: a test below counts GETs)."""
        listed = self.akube.list(ImpVMResource, namespace=self.namespace)
        return {o.metadata.name: o.to_dict() async for o in listed}

    @contextlib.asynccontextmanager
    async def agent(
        self, tick: float = 0.2, preflight: Preflight | None = None
    ) -> AsyncIterator[Agent]:
        """An agent with the process runtime, running for the block."""
        store = ImageStore(self.tmp_path / "cache", 1 << 30, {self.images.registry})
        self.node = f"node-{uuid.uuid4().hex[:6]}"
        agent = Agent(
            self.akube,
            ProcessRuntime(store),
            AgentConfig(
                node_name=self.node,
                capacity=Resources(8, 8192),
                workdir=self.tmp_path / "agent",
                lease_namespace=self.namespace,
                tick_seconds=tick,
                stop_grace_seconds=2.0,
            ),
            preflight,
            jit=SecretJitSource(self.akube),  # the admin client may read the Secret
        )
        task = asyncio.create_task(agent.run())
        try:
            yield agent
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
def env(
    kube: Client, akube: AsyncClient, namespace: str, tmp_path: Path, images: Images
) -> Iterator[Env]:
    e = Env(kube, akube, namespace, tmp_path, images)
    yield e
    with contextlib.suppress(Exception):
        kube.delete(ImpVMClassResource, e.cls)


def condition(vm: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next(
        (c for c in (vm.get("status") or {}).get("conditions") or [] if c["type"] == type_), None
    )


async def test_vm_of_a_missing_class_is_refused_by_name_until_the_class_exists(env: Env) -> None:
    """No fallback size: VMs bound to the node are not booted while their class is missing;
    each says which class, with a Warning. Once the class exists both run. An unbound VM is
    never touched: the operator places VMs, not the agent."""
    async with env.agent() as agent:
        node = agent.config.node_name
        env.create_vm("free", env.images.sleep, node="")
        env.create_vm("bound", env.images.sleep)
        env.create_vm("bound-too", env.images.sleep)

        async def both_refused() -> bool:
            got = await env.vms()
            return all(condition(got[n], "ClassMissing") for n in ("bound", "bound-too"))

        await until("both VMs refused", both_refused)
        for name in ("bound", "bound-too"):
            vm = (await env.vms())[name]
            cond = condition(vm, "ClassMissing")
            assert cond is not None and cond["status"] == "True", (name, cond)
            assert f"'{env.cls}'" in cond["message"]
            assert (vm.get("status") or {}).get("phase") is None, name  # not booted
        free = (await env.vms())["free"]
        assert not free["spec"].get("nodeName") and not free.get("status")  # untouched
        assert not (env.tmp_path / "agent" / "vms").exists() or not any(
            (env.tmp_path / "agent" / "vms").iterdir()
        )
        events = [e async for e in env.akube.list(Event, namespace=env.namespace)]
        refused = {e.involvedObject.name for e in events if e.reason == "ClassNotFound"}
        assert refused == {"bound", "bound-too"}
        assert all(env.cls in (e.message or "") for e in events if e.reason == "ClassNotFound")
        assert all(e.type == "Warning" for e in events if e.reason == "ClassNotFound")

        env.create_class()

        async def both_running() -> bool:
            got = await env.vms()
            return all(
                (got[n].get("status") or {}).get("phase") == "Running"
                for n in ("bound", "bound-too")
            )

        await until("both VMs running once the class exists", both_running)
        for name in ("bound", "bound-too"):
            vm = (await env.vms())[name]
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
    env: Env, control_plane: ControlPlane
) -> None:
    """Two running VMs, a tick of 0.2 s: over 3 s the agent sends the API server no GET and
    no LIST of ImpVMs or ImpVMClasses (its watches tell it everything; it used to GET each VM
    and its class every tick)."""
    env.create_class()
    async with env.agent(tick=0.2):
        for name in ("a", "b"):
            env.create_vm(name, env.images.sleep)

        async def running() -> bool:
            got = await env.vms()
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


async def test_agent_forgets_the_vms_it_is_done_with(env: Env) -> None:
    """Five VMs run (the probe runner exits 3), are reported Failed and deleted: afterwards the
    agent holds no worker and no per-VM state for any of them, and its runtime none either
    (these maps used to grow with every VM the node ever ran)."""
    env.create_class()
    async with env.agent() as agent:
        names = [f"vm-{i}" for i in range(5)]
        for name in names:
            env.create_vm(name, env.images.probe)

        async def all_failed() -> bool:
            got = await env.vms()
            return len(got) == 5 and all(
                (v.get("status") or {}).get("exitCode") == 3 and not v["metadata"].get("finalizers")
                for v in got.values()
            )

        await until("all VMs ran, failed and were released", all_failed, 120)
        for name in names:
            env.kube.delete(ImpVMResource, name, namespace=env.namespace)

        async def forgotten() -> bool:
            return not await env.vms() and not agent.tracked()

        await until("the agent forgot every VM", forgotten)
        assert isinstance(agent.runtime, ProcessRuntime) and agent.runtime.known() == set()
        assert len(agent.mine.store) == 0


async def test_a_failed_vm_keeps_its_console_for_impvm_logs(
    env: Env, control_plane: ControlPlane
) -> None:
    """A runner that fails at start: the VM's status carries the console's last lines and
    where the full console is kept; an Event says so; the kept copy is bounded and holds no
    JIT config; ``impvm logs`` prints it, also once the VM is deleted."""
    env.create_class()
    async with env.agent():
        env.create_vm("broken", env.images.failing)

        async def failed() -> dict[str, Any] | None:
            vm = (await env.vms()).get("broken")
            st = (vm or {}).get("status") or {}
            # and released (finalizer gone), or the stopped agent would hold its deletion
            released = vm is not None and not vm["metadata"].get("finalizers")
            return vm if st.get("phase") == "Failed" and st.get("consoleLog") and released else None

        await until("the VM failed and was released", failed, 120)
        vm = await failed()
        assert vm is not None
    st = vm["status"]
    assert st["consoleTail"].endswith("runner: cannot reach GitHub: connection refused")
    assert len(st["consoleTail"].splitlines()) <= 20
    node, _, path = st["consoleLog"].partition(":")
    assert node == vm["spec"]["nodeName"]
    kept = Path(path)
    assert kept.parent == env.tmp_path / "agent" / "consoles"
    data = await asyncio.to_thread(kept.read_bytes)
    assert len(data) <= 1024 * 1024 and b"bytes cut ...]" in data
    assert b"raw=***" in data and b"jit-not-a-real-one" not in data
    assert (await asyncio.to_thread(kept.stat)).st_mode & 0o777 == 0o600
    events = [e async for e in env.akube.list(Event, namespace=env.namespace)]
    (ev,) = [e for e in events if e.reason == "ConsoleLogKept"]
    assert path in (ev.message or "")
    for e in events:  # the JIT config is in no Event
        assert "jit-not-a-real-one" not in (e.message or "")
    assert "jit-not-a-real-one" not in repr(vm)

    def impvm_logs() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "impvm.cli", "logs", "-n", env.namespace, "broken"],
            env=dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig)),
            capture_output=True,
            timeout=60,
            check=False,
        )

    out = await asyncio.to_thread(impvm_logs)
    assert out.returncode == 0, out.stderr
    assert out.stdout == data
    env.kube.delete(ImpVMResource, "broken", namespace=env.namespace)

    async def gone() -> bool:
        return "broken" not in await env.vms()

    await until("the VM deleted", gone)
    out = await asyncio.to_thread(impvm_logs)  # found through its Event
    assert out.returncode == 0, out.stderr
    assert out.stdout == data
    await asyncio.to_thread(kept.unlink)
    out = await asyncio.to_thread(impvm_logs)
    assert out.returncode == 1 and f"on node {node} at {path}" in out.stderr.decode()


async def test_an_agent_that_failed_its_preflight_runs_nothing_and_says_why(env: Env) -> None:
    """The Lease says the checks failed (the operator binds no VM there); a VM bound there
    anyway fails with NodePreflightFailed, so its pool replaces it elsewhere."""
    from lightkube.resources.coordination_v1 import Lease

    env.create_class()
    failed = Preflight(ok=False, reason="bwrap: not found on PATH (apt-get install bubblewrap)")
    async with env.agent(preflight=failed) as agent:
        env.create_vm("waiting", env.images.sleep)
        name = "impvm-agent-" + agent.config.node_name

        async def advertised() -> bool:
            try:
                lease = await env.akube.get(Lease, name, namespace=env.namespace)
            except Exception:
                return False
            ann = (lease.metadata.annotations or {}) if lease.metadata else {}
            return ann.get("imp.dev/preflight", "").startswith("failed: bwrap")

        await until("the Lease says the preflight failed", advertised)

        async def refused() -> bool:
            return ((await env.vms())["waiting"].get("status") or {}).get("phase") == "Failed"

        await until("the VM bound there failed", refused)
        status = (await env.vms())["waiting"]["status"]
        assert status["exitReason"] == "NodePreflightFailed" and "bwrap" in status["message"]
        assert not (env.tmp_path / "agent" / "vms").exists() or not any(
            (env.tmp_path / "agent" / "vms").iterdir()
        )
