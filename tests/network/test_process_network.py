"""The process runtime under the same policy: bubblewrap starts inside the VM's own network
namespace (a veth pair to the node, the same nftables chains as a QEMU guest), with the node's
resolvers in its /etc/resolv.conf."""

from __future__ import annotations

import os
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.network.node import NodeNetwork
from impvm.agent.network.policy import DEFAULT_LAYER, Allow, EgressLayer, PortRange
from impvm.agent.process import ProcessRuntime
from impvm.agent.runtime import Secret

from .conftest import World, policy_off
from .probe import probe_request


async def test_sandbox_gets_its_own_namespace_and_the_same_egress_policy(
    world: World,
    node_network: NodeNetwork,
    shared_store: ImageStore,
    probe_images: tuple[str, str],
    tmp_path: Path,
) -> None:
    rt = ProcessRuntime(shared_store, network=node_network)
    layers = (
        DEFAULT_LAYER,
        EgressLayer("vm", "allowlist", (Allow(f"{world.a}/32", (PortRange("tcp", 80, 8080),)),)),
    )
    req = probe_request(tmp_path, "sandbox", probe_images, layers)
    try:
        await rt.start(req, Secret(world.control.jit(req.name)))
        ctl = world.control
        await ctl.up("sandbox", seconds=60)
        (att,) = node_network.attachments()
        gw = node_network.config.gateway(att.slot)
        assert await ctl.run(
            "sandbox",
            f"tcp {world.a} 80",
            f"tcp {world.a} 8080",  # in the range
            f"tcp {world.b} 80",  # not listed
            "tcp 169.254.169.254 80",
            f"tcp {gw} {world.host_service_port}",
            "dns github.test",  # /etc/resolv.conf names the node's resolver
        ) == ["ok:internet-a", "ok:internet-a-8080", "fail", "fail", "fail", f"ok:{world.a}"]
        # the sandbox runs in the VM's namespace, not the agent's
        vm_ns = f"net:[{os.stat(f'/run/netns/{node_network.config.ifname(att.slot)}').st_ino}]"
        assert _sandbox_netns(rt, req.vm_id) == vm_ns
        assert os.readlink(f"/proc/{os.getpid()}/ns/net") != vm_ns
        policy_off(world, node_network.config.ifname(att.slot), att.slot)
        assert await ctl.run("sandbox", f"tcp {gw} {world.host_service_port}") == [
            "ok:host-service"
        ]
    finally:
        await rt.cleanup(req)
        await node_network.start()
    assert world.links() == []


def _sandbox_netns(rt: ProcessRuntime, vm_id: str) -> str:
    pid = rt._vms[vm_id].proc.pid  # bwrap, exec'd by nsenter
    return os.readlink(f"/proc/{pid}/ns/net")
