"""QEMU guests on their own tap devices behind the node's nftables table: booted VMs (the probe
agent as their runner) ask the test's control server in the "internet" namespace what to
probe. What a guest must not reach is real: a kube-apiserver listening on every host address
(its default), an HTTP service on every host address, another running guest, 169.254.169.254
and a private address on test hosts; each negative probe is shown succeeding with the policy
off or the destination allowlisted, so none of them passes vacuously."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from impvm.agent.images import ImageStore
from impvm.agent.network.node import NodeNetwork
from impvm.agent.network.policy import DEFAULT_LAYER, Allow, EgressLayer, PortRange
from impvm.agent.network.ruleset import render
from impvm.agent.qemu import QemuRuntime
from impvm.agent.runtime import Secret, VMRequest
from impvm.kube.controlplane import ControlPlane

from .conftest import World, kernel_log, policy_off
from .probe import probe_request

TCP80 = (PortRange("tcp", 80, 80),)


@pytest.fixture(scope="module")
def exposed_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A kube-apiserver bound to every host address, as kube-apiserver binds by default."""
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("exposed-cp"), bind_address="0.0.0.0")
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rt(
    qemu_runtime: QemuRuntime,
    shared_store: ImageStore,
    node_network: NodeNetwork,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[QemuRuntime]:
    """The qemu runtime (kernel, initramfs and accelerator probed once) with the node network."""
    yield QemuRuntime(
        shared_store,
        kernel=qemu_runtime.kernel,
        initramfs=qemu_runtime.initramfs,
        accel=qemu_runtime.accel,
        state_dir=tmp_path_factory.mktemp("qemu-net-state"),
        network=node_network,
    )


async def _boot(rt: QemuRuntime, world: World, req: VMRequest) -> None:
    await rt.start(req, Secret(world.control.jit(req.name)))
    try:
        await world.control.up(req.name, seconds=300)
    except TimeoutError:
        state = await rt.inspect(req)
        raise AssertionError(f"guest {req.name} never asked: {state.log_tail}") from None


async def test_guest_reaches_the_internet_and_dns_but_not_the_host_another_guest_or_metadata(
    rt: QemuRuntime,
    world: World,
    node_network: NodeNetwork,
    exposed_apiserver: ControlPlane,
    probe_images: tuple[str, str],
    tmp_path: Path,
) -> None:
    a = probe_request(tmp_path, "guest-a", probe_images)
    b = probe_request(tmp_path, "guest-b", probe_images)
    try:
        await asyncio.gather(_boot(rt, world, a), _boot(rt, world, b))
        ctl = world.control
        assert await ctl.run("guest-b", "serve 8081") == ["ok"]
        att = {x.vm_id: x for x in node_network.attachments()}
        gw_a = node_network.config.gateway(att[a.vm_id].slot)
        b_addr = node_network.config.guest_address(att[b.vm_id].slot)
        assert await ctl.run(
            "guest-a", f"tcp {world.a} 80", f"tcp {world.b} 80", "dns github.test"
        ) == ["ok:internet-a", "ok:internet-b", f"ok:{world.a}"]
        forbidden = [
            f"tcp {gw_a} {exposed_apiserver.api_port}",  # kube-apiserver on the host
            f"tcp {gw_a} {world.host_service_port}",  # a host service, via the gateway
            f"tcp {world.internet.host_address} {world.host_service_port}",  # via the uplink
            f"tcp {b_addr} 8081",  # the other guest
            "tcp 169.254.169.254 80",  # metadata
            "tcp 172.31.254.2 80",  # a private address
        ]
        assert await ctl.run("guest-a", *forbidden) == ["fail"] * 6
        # refused at once with ICMP admin-prohibited, like an address no guest holds (a drop
        # would show as nc's timeout)
        free = node_network.config.guest_address(node_network.config.slots - 1)
        assert await ctl.run("guest-a", f"connect {b_addr} 8081", f"connect {free} 8081") == [
            "unreachable",
            "unreachable",
        ]
        # with the policy off the same probes get through: the test can fail
        slot_a = att[a.vm_id].slot
        policy_off(world, node_network.config.ifname(slot_a), slot_a)
        got = await ctl.run("guest-a", *forbidden)
        assert [r.split(":")[0] for r in got] == ["ok"] * 6, got
        assert got[1:] == [
            "ok:host-service",
            "ok:host-service",
            "ok:guest-guest-b",
            "ok:metadata",
            "ok:lan",
        ]
        # a restarted agent rebuilds the table from what is running: blocked again, and the
        # guests keep their internet
        await NodeNetwork(node_network.config, node_network.state_dir).start()
        assert await ctl.run("guest-a", *forbidden) == ["fail"] * 6
        assert await ctl.run("guest-b", f"tcp {world.a} 80") == ["ok:internet-a"]
    finally:
        await asyncio.gather(rt.cleanup(a), rt.cleanup(b))


async def test_allowlist_lets_through_only_what_it_lists_and_audit_logs_instead_of_dropping(
    rt: QemuRuntime,
    world: World,
    probe_images: tuple[str, str],
    tmp_path: Path,
) -> None:
    ctl = f"{world.a}/32"
    metadata = Allow("169.254.169.254/32", TCP80)
    allow = probe_request(
        tmp_path,
        "allow",
        probe_images,
        (
            EgressLayer("class", allow=(metadata,)),
            EgressLayer(
                "vm",
                "allowlist",
                (Allow(ctl, (PortRange("tcp", 80, 80), PortRange("tcp", 8000, 8000))), metadata),
            ),
        ),
    )
    audit = probe_request(
        tmp_path,
        "audit",
        probe_images,
        (
            DEFAULT_LAYER,
            EgressLayer(
                "vm", "allowlist", (Allow(ctl, (PortRange("tcp", 8000, 8000),)),), audit=True
            ),
        ),
    )
    probes = [
        f"tcp {world.a} 80",
        f"tcp {world.a} 8080",
        f"tcp {world.b} 80",
        "tcp 169.254.169.254 80",
        "tcp 172.31.254.2 80",
        "dns github.test",
    ]
    try:
        await asyncio.gather(_boot(rt, world, allow), _boot(rt, world, audit))
        assert await world.control.run("allow", *probes) == [
            "ok:internet-a",
            "fail",  # same address, port not listed
            "fail",  # not listed
            "ok:metadata",  # listed (and opened by the class)
            "fail",  # private, not listed
            f"ok:{world.a}",  # DNS is always answered
        ]
        assert await world.control.run("audit", *probes) == [
            "ok:internet-a",
            "ok:internet-a-8080",  # would be dropped: logged, let through
            "ok:internet-b",
            "fail",  # the class layer enforces: metadata stays out
            "fail",
            f"ok:{world.a}",
        ]
        log = kernel_log()
        audit_lines = [ln for ln in log.splitlines() if "impvm audit vm t/audit: " in ln]
        for dst, port in ((world.a, 80), (world.a, 8080), (world.b, 80)):
            assert any(f"DST={dst} " in ln and f"DPT={port} " in ln for ln in audit_lines), log[
                -3000:
            ]
        assert "impvm audit vm t/allow: " not in log  # enforcing: nothing logged
    finally:
        await asyncio.gather(rt.cleanup(allow), rt.cleanup(audit))


async def test_50_create_delete_cycles_leave_no_tap_and_no_rule(
    rt: QemuRuntime,
    world: World,
    node_network: NodeNetwork,
    probe_images: tuple[str, str],
    tmp_path: Path,
) -> None:
    """Start (QEMU opens the tap) and clean up 50 VMs, 5 at a time."""
    assert node_network.attachments() == []

    async def cycle(i: int) -> None:
        req = probe_request(tmp_path, f"cycle-{i}", probe_images)
        await rt.start(req, Secret(world.control.jit(req.name)))
        # this VM's own tap: another cycle's attachment may be half made (record before tap)
        (att,) = [a for a in node_network.attachments() if a.vm_id == req.vm_id]
        assert node_network.config.ifname(att.slot) in world.links()
        await rt.cleanup(req)

    for batch in range(10):
        await asyncio.gather(*(cycle(batch * 5 + k) for k in range(5)))
    assert world.links() == []
    table = world.nft_table()
    assert table["map_elements"] == []
    assert not [c for c in table["chains"] if str(c).startswith("vm-")]
    assert (node_network.state_dir / "ruleset.nft").read_text() == render(node_network.config, [])
    assert list(node_network.state_dir.glob("*.json")) == []
    assert os.listdir(tmp_path) == []
