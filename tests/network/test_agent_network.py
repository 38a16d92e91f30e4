"""The whole path from the API to the node's rules: a real agent (process runtime, on the node
network) claims an ImpVM; its ImpVMClass's egress policy and its own (a pool's, as the operator
copies it) both reach the sandbox's chain, and a packet passes only when both allow it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.images import ImageStore
from impvm.agent.jitsource import SecretJitSource
from impvm.agent.network.node import NodeNetwork
from impvm.agent.process import ProcessRuntime
from impvm.api.models import API_VERSION, JIT_SECRET_KEY
from impvm.api.resources import ImpVMClassResource, ImpVMResource

from .conftest import World

pytestmark = [pytest.mark.controlplane]


async def test_class_and_vm_policies_reach_the_vm_through_the_agent(
    world: World,
    node_network: NodeNetwork,
    shared_store: ImageStore,
    probe_images: tuple[str, str],
    akube: AsyncClient,
    namespace: str,
    tmp_path: Path,
) -> None:
    cls, name = f"net-{uuid.uuid4().hex[:6]}", "probed"
    node = f"node-{uuid.uuid4().hex[:6]}"
    await akube.create(
        ImpVMClassResource.from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ImpVMClass",
                "metadata": {"name": cls},
                "spec": {
                    "vcpu": 1,
                    "memoryMiB": 256,
                    "diskGiB": 1,
                    "network": {
                        "egress": {
                            "policy": "allowlist",
                            "allow": [{"cidr": f"{world.a}/32"}],
                        }
                    },
                },
            }
        )
    )
    jit = base64.b64encode(world.control.jit(name).encode()).decode()
    await akube.create(
        Secret(
            metadata=ObjectMeta(name=f"{name}-jit", namespace=namespace),
            data={JIT_SECRET_KEY: jit},
        )
    )
    vm: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ImpVM",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "classRef": {"name": cls},
            "image": probe_images[0],
            "runnerLayer": probe_images[1],
            "runnerConfigSecret": f"{name}-jit",
            "nodeName": node,  # as the operator's placement binds it
            # the pool's layer, as the operator copies it: ports 80 and 8000 (the control server)
            "network": {
                "egress": {
                    "policy": "allowlist",
                    "allow": [{"cidr": "0.0.0.0/0", "ports": [{"port": 80}, {"port": 8000}]}],
                }
            },
        },
    }
    await akube.create(ImpVMResource.from_dict(vm))
    agent = Agent(
        akube,
        ProcessRuntime(shared_store, network=node_network),
        AgentConfig(
            node_name=node,
            capacity=Resources(2, 2048),
            workdir=tmp_path / "agent",
            lease_namespace=namespace,
            tick_seconds=0.2,
            stop_grace_seconds=1.0,
        ),
        jit=SecretJitSource(akube),  # the admin client may read the Secret
    )
    task = asyncio.create_task(agent.run())
    try:
        await world.control.up(name, seconds=120)
        assert await world.control.run(
            name,
            f"tcp {world.a} 80",  # both layers allow it
            f"tcp {world.b} 80",  # the VM's layer allows it, the class's does not
            "tcp 169.254.169.254 80",  # the same
            f"tcp {world.a} 8080",  # the class's layer allows it, the VM's does not
        ) == ["ok:internet-a", "fail", "fail", "fail"]
        (att,) = node_network.attachments()
        assert (att.namespace, att.name) == (namespace, name)
        assert [layer.name for layer in att.layers] == ["class", "vm"]
        world.control.commands[name].append("exit 0")
        for _ in range(300):  # the agent records the exit, cleans up, detaches
            obj = (await akube.get(ImpVMResource, name, namespace=namespace)).to_dict()
            if (obj.get("status") or {}).get(
                "phase"
            ) == "Succeeded" and not node_network.attachments():
                break
            await asyncio.sleep(0.1)
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        assert node_network.attachments() == [] and world.links() == []
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(ApiError):
            await akube.delete(ImpVMClassResource, cls)
        await node_network.start()
