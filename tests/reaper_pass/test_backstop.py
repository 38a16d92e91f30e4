"""The backstop that needs no GitHub call (like a Job's activeDeadlineSeconds):
a VM past its ``expireAfter`` is stopped by the real agent (process runtime, bubblewrap) with
phase Failed / exitReason DeadlineExceeded, whatever its runner is doing."""

from __future__ import annotations

import asyncio
import base64
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.jitsource import SecretJitSource
from impvm.agent.process import ProcessRuntime
from impvm.api.models import API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

from .conftest import now, ts

pytestmark = [pytest.mark.controlplane]

# A runner that never finishes: only the deadline can end it.
HUNG_RUN_SH = "#!/bin/sh\necho ready\nexec sleep 3600\n"


async def wait_vm(kube: AsyncClient, ns: str, name: str, pred: Any, seconds: float) -> Any:
    for _ in range(int(seconds * 10)):
        obj = (await kube.get(ImpVMResource, name, namespace=ns)).to_dict()
        if pred(obj.get("status") or {}):
            return obj
        await asyncio.sleep(0.1)
    raise AssertionError(f"VM {name} never reached the expected state; last {obj.get('status')}")


async def test_expire_after_stops_a_hung_vm(
    kube: Client, akube: AsyncClient, namespace: str, tmp_path: Path
) -> None:
    async with LocalRegistry() as registry:
        base = await build_base_image(tmp_path / "base", registry.address)
        layer = await build_runner_layer_image(
            tmp_path / "layer", registry.address, run_sh=HUNG_RUN_SH, tag="hung"
        )
        cls = f"reaper-backstop-{uuid.uuid4().hex[:6]}"
        node = f"node-{uuid.uuid4().hex[:6]}"
        kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVMClass",
                    "metadata": {"name": cls},
                    "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1},
                }
            )
        )
        kube.create(
            Secret(
                metadata=ObjectMeta(name="vm-jit", namespace=namespace),
                data={JIT_SECRET_KEY: base64.b64encode(b"jit-not-a-real-one").decode()},
            )
        )
        kube.create(
            ImpVMResource.from_dict(
                {
                    "apiVersion": API_VERSION,
                    "kind": "ImpVM",
                    "metadata": {"name": "hung", "namespace": namespace},
                    "spec": {
                        "classRef": {"name": cls},
                        "image": base,
                        "runnerLayer": layer,
                        "runnerConfigSecret": "vm-jit",
                        "expireAfter": "60s",
                        "nodeName": node,  # as the operator's placement binds it
                    },
                }
            )
        )
        runtime = ProcessRuntime(
            ImageStore(tmp_path / "cache", 1 << 30, {registry.address}),
        )
        agent = Agent(
            akube,
            runtime,
            AgentConfig(
                node_name=node,
                capacity=Resources(4, 4096),
                workdir=tmp_path / "agent",
                lease_namespace=namespace,
                tick_seconds=0.2,
                stop_grace_seconds=2.0,
            ),
            jit=SecretJitSource(akube),  # the admin client may read the Secret
        )
        task = asyncio.create_task(agent.run())
        try:
            running = await wait_vm(
                akube, namespace, "hung", lambda s: s.get("phase") == "Running", 60
            )
            assert running["status"].get("exitReason") is None
            vms_dir = tmp_path / "agent" / "vms"
            assert len(list(vms_dir.iterdir())) == 1  # the running sandbox's private dir
            # The deadline counts from status.startedAt. Rather than sleep the 60 s minimum
            # the API allows, move the recorded start 2 minutes back: the agent reads it on
            # its next tick, exactly as it would after 2 minutes of a hung runner.
            await akube.patch(
                ImpVMResource.Status,
                "hung",
                {"status": {"startedAt": ts(now() - timedelta(minutes=2))}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )
            failed = await wait_vm(
                akube, namespace, "hung", lambda s: s.get("phase") == "Failed", 30
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            kube.delete(ImpVMClassResource, cls)
        status = failed["status"]
        assert status["exitReason"] == "DeadlineExceeded"
        assert "expireAfter 60s" in status["message"] and status.get("finishedAt")
        # the sandbox is stopped and its scratch removed
        assert list(vms_dir.iterdir()) == []
