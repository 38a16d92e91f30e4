"""The node network on real nftables and real interfaces, with namespace guests: a VM's network
as the process runtime gets it (a veth pair into a namespace of its own), probed from inside that
namespace. The same table and rules serve QEMU guests (tests/network/test_qemu_network.py); these
tests cover the policy matrix and the repair paths in seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from impvm.agent.network.node import NetworkError, NodeNetwork
from impvm.agent.network.plan import Attachment, NetConfig
from impvm.agent.network.policy import (
    DEFAULT_LAYER,
    Allow,
    EgressLayer,
    PortRange,
    layer_verdict,
    names_protected,
)
from impvm.agent.network.ruleset import render
from impvm.devstack.netns import GUEST_RANGES, pick_subnet

from .conftest import World, connect_error, dns_probe, kernel_log, nc_probe, policy_off, sh

TCP80 = (PortRange("tcp", 80, 80),)


async def _attach(nn: NodeNetwork, tmp_path: Path, name: str, layers: tuple[EgressLayer, ...] = ()):
    wd = tmp_path / name
    wd.mkdir(exist_ok=True)
    return await nn.attach(
        vm_id=f"t.{name}.0000", namespace="t", name=name, workdir=wd, layers=layers, kind="netns"
    )


def _targets(world: World) -> dict[str, tuple[str, int, str]]:
    """name -> (address, port, what its server answers)."""
    return {
        "a:80": (world.a, 80, "internet-a"),
        "a:8080": (world.a, 8080, "internet-a-8080"),
        "b:80": (world.b, 80, "internet-b"),
        "metadata": ("169.254.169.254", 80, "metadata"),
        "lan": ("172.31.254.2", 80, "lan"),
    }


async def test_public_guest_reaches_the_internet_not_the_host_other_guests_metadata_or_lan(
    world: World, node_network: NodeNetwork, tmp_path: Path
) -> None:
    g = await _attach(node_network, tmp_path, "pub")
    other = await _attach(node_network, tmp_path, "other")
    httpd = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", other.ifname, "busybox", "httpd", "-f", "-p", "8081", "-h",
        str(tmp_path),
    )  # fmt: skip
    (tmp_path / "index.html").write_text("guest-other\n")
    host_addrs = [g.gateway, str(world.internet.host_address)]
    ns = g.ifname
    try:
        assert g.netns is not None and g.dns == (world.dns,)
        assert await nc_probe(ns, world.a, 80) == "internet-a"
        assert await nc_probe(ns, world.b, 80) == "internet-b"
        assert await dns_probe(ns, "github.test", world.dns) == world.a

        async def blocked() -> list[object]:
            return [
                *[await nc_probe(ns, h, world.host_service_port) for h in host_addrs],
                await nc_probe(ns, other.address, 8081),
                await nc_probe(ns, "169.254.169.254", 80),
                await nc_probe(ns, "172.31.254.2", 80),
            ]

        assert await blocked() == [None] * 5
        # the same probes succeed with the policy off: the test can fail
        slot = node_network.config.slot_of(ns)
        assert slot is not None
        policy_off(world, ns, slot)
        assert await blocked() == ["host-service"] * 2 + ["guest-other", "metadata", "lan"]
        await node_network.start()  # a rebuild puts the rules back
        assert await blocked() == [None] * 5
    finally:
        httpd.terminate()
        await httpd.wait()
        await node_network.detach("t.pub.0000")
        await node_network.detach("t.other.0000")


async def test_a_guest_connecting_to_another_guest_is_rejected_at_once_like_a_free_address(
    world: World, node_network: NodeNetwork, tmp_path: Path
) -> None:
    """Guest to guest is rejected with ICMP admin-prohibited ("No route to host"), not dropped:
    the job's connect fails at once instead of hanging, and a neighbour that exists answers
    exactly like a slot nobody holds, so the answer reveals no other VM. The connect waits up to
    30 s: a dropped packet shows as ``timeout``, whatever the machine's load."""
    a = await _attach(node_network, tmp_path, "near-a")
    b = await _attach(node_network, tmp_path, "near-b")
    cfg = node_network.config
    free = cfg.guest_address(cfg.slots - 1)  # no guest holds the last slot
    httpd = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", b.ifname, "busybox", "httpd", "-f", "-p", "8081", "-h",
        str(tmp_path),
    )  # fmt: skip
    (tmp_path / "index.html").write_text("guest-near-b\n")
    try:
        # b serves (from b's own namespace it connects), and the way from a to it is rejected
        assert await connect_error(b.ifname, b.address, 8081) == "connected"
        assert await connect_error(a.ifname, b.address, 8081) == "unreachable"
        assert await connect_error(a.ifname, free, 8081) == "unreachable"
        assert await connect_error(b.ifname, a.address, 22) == "unreachable"
        # the same connect gets through with a's rules off: the probe can tell
        slot = cfg.slot_of(a.ifname)
        assert slot is not None
        subprocess_rule = f'iifname "{a.ifname}" accept'
        sh("nft", "insert", "rule", "inet", cfg.table, "forward", *subprocess_rule.split())
        assert await connect_error(a.ifname, b.address, 8081) == "connected"
    finally:
        httpd.terminate()
        await httpd.wait()
        await node_network.start()
        await node_network.detach("t.near-a.0000")
        await node_network.detach("t.near-b.0000")


# (class layer, vm layer or None): the policy matrix, judged against layer_verdict
POLICIES: list[tuple[EgressLayer, EgressLayer | None]] = [
    (DEFAULT_LAYER, None),
    (EgressLayer("class", allow=(Allow("169.254.169.254/32", TCP80),)), None),
    (DEFAULT_LAYER, EgressLayer("vm", "allowlist", (Allow("0.0.0.0/0", TCP80),))),
    (
        EgressLayer("class", "allowlist", (Allow("203.0.113.0/24"), Allow("198.51.100.0/24"))),
        EgressLayer("vm", "allowlist", (Allow("0.0.0.0/0", (PortRange("tcp", 8000, 8080),)),)),
    ),
    (
        EgressLayer("class", allow=(Allow("172.31.254.0/30", (PortRange("tcp", 70, 90),)),)),
        EgressLayer(
            "vm",
            "allowlist",
            (Allow("172.31.254.2/32", TCP80), Allow("0.0.0.0/0", (PortRange("udp", 80, 80),))),
        ),
    ),
    (DEFAULT_LAYER, EgressLayer("vm", "allowlist", (), audit=True)),
    (EgressLayer("class", "allowlist", (), audit=True), None),
]


@pytest.mark.parametrize("policy", range(len(POLICIES)))
async def test_policy_matrix_matches_the_reference_semantics(
    world: World, node_network: NodeNetwork, tmp_path: Path, policy: int
) -> None:
    """Each target is reachable exactly when every layer lets it through (layer_verdict), and
    DNS is answered whatever the policy."""
    layers = tuple(x for x in POLICIES[policy] if x is not None)
    g = await _attach(node_network, tmp_path, f"m{policy}", layers)
    try:
        for target, (addr, port, answer) in _targets(world).items():
            verdicts = [layer_verdict(layer, addr, "tcp", port) for layer in layers]
            want = answer if "reject" not in verdicts else None
            got = await nc_probe(g.ifname, addr, port)
            assert got == want, (target, verdicts)
        assert await dns_probe(g.ifname, "github.test", world.dns) == world.a
    finally:
        await node_network.detach(f"t.m{policy}.0000")


def _protected_policies(world: World) -> list[tuple[EgressLayer, ...]]:
    """Policies against protected networks: internet address b stands for a node's public
    address, the lan host for a pod network; each opens something, only some name them."""
    b = f"{world.b}/32"
    return [
        (DEFAULT_LAYER,),
        (EgressLayer("class", allow=(Allow("0.0.0.0/0"),)),),  # everything, naming nothing
        (EgressLayer("class", allow=(Allow("172.31.254.0/24"), Allow("203.0.113.0/24"))),),
        (EgressLayer("class", allow=(Allow(b, TCP80), Allow("172.31.254.2/32", TCP80))),),
        (
            EgressLayer("class", allow=(Allow(b, TCP80),)),
            EgressLayer("vm", "allowlist", (Allow("0.0.0.0/0", TCP80),)),  # names none
        ),
    ]


@pytest.mark.parametrize("policy", range(5))
async def test_protected_networks_are_reached_only_where_every_layer_names_them(
    world: World, node_network: NodeNetwork, tmp_path: Path, policy: int
) -> None:
    """With b and the lan host protected (as a node's address and a pod network are), a
    wide allow entry - even 0.0.0.0/0 - opens neither; an entry inside them does, when every
    layer has one. What the kernel does is what names_protected and layer_verdict say."""
    protected = (f"{world.b}/32", "172.31.254.0/30")
    layers = _protected_policies(world)[policy]
    await node_network.set_protected(protected)
    g = await _attach(node_network, tmp_path, f"p{policy}", layers)
    try:
        for target, (addr, port, answer) in _targets(world).items():
            verdicts = [layer_verdict(layer, addr, "tcp", port) for layer in layers]
            passes = names_protected(layers, protected, addr, "tcp", port)
            want = answer if passes and "reject" not in verdicts else None
            got = await nc_probe(g.ifname, addr, port)
            assert got == want, (target, verdicts, passes)
        if policy in (1, 2):  # the wide entries open the rest of their range
            assert await nc_probe(g.ifname, world.a, 80) == "internet-a"
    finally:
        await node_network.detach(f"t.p{policy}.0000")
        await node_network.set_protected(())


async def test_audit_logs_what_it_would_drop_with_a_prefix_naming_the_vm(
    world: World, node_network: NodeNetwork, tmp_path: Path
) -> None:
    audit = EgressLayer("vm", "allowlist", (Allow(f"{world.a}/32", TCP80),), audit=True)
    enforce = EgressLayer("vm", "allowlist", (Allow(f"{world.a}/32", TCP80),))
    ga = await _attach(node_network, tmp_path, "auditing", (DEFAULT_LAYER, audit))
    ge = await _attach(node_network, tmp_path, "enforcing", (DEFAULT_LAYER, enforce))
    try:
        assert await nc_probe(ga.ifname, world.a, 8080) == "internet-a-8080"
        assert await nc_probe(ge.ifname, world.a, 8080) is None
        # the class layer still enforces: metadata stays out even for the auditing VM
        assert await nc_probe(ga.ifname, "169.254.169.254", 80) is None
        log = kernel_log()
        hits = [ln for ln in log.splitlines() if "impvm audit vm t/auditing: " in ln]
        assert any(f"DST={world.a}" in ln and "DPT=8080" in ln for ln in hits), log[-2000:]
        assert not any("DPT=80 " in ln for ln in hits)  # allowed traffic is not logged
        assert "impvm audit vm t/enforcing: " not in log
    finally:
        await node_network.detach("t.auditing.0000")
        await node_network.detach("t.enforcing.0000")


async def test_a_restarted_agent_rebuilds_the_table_and_repairs_a_crash(
    world: World, node_network: NodeNetwork, tmp_path: Path
) -> None:
    g1 = await _attach(node_network, tmp_path, "r1")
    g2 = await _attach(node_network, tmp_path, "r2")
    before = (node_network.state_dir / "ruleset.nft").read_text()
    cfg = node_network.config
    t = cfg.table
    try:
        # the crash: the table is gone, an interface and a namespace no record owns are left, and a
        # record outlived its VM's workdir
        sh("nft", "delete", "table", "inet", t)
        orphan_link, orphan_ns = cfg.ifname(cfg.slots - 1), cfg.ifname(cfg.slots - 2)
        sh("ip", "tuntap", "add", "dev", orphan_link, "mode", "tap")
        sh("ip", "netns", "add", orphan_ns)
        stale = Attachment(
            "t.gone.0000", "t", "gone", cfg.slots - 3, "netns", (), str(tmp_path / "gone")
        )
        (node_network.state_dir / "t.gone.0000.json").write_text(stale.to_json())
        host = (g1.gateway, world.host_service_port)
        assert await nc_probe(g1.ifname, *host) == "host-service"  # unprotected now
        restarted = NodeNetwork(cfg, node_network.state_dir)
        await restarted.start()
        assert [a.vm_id for a in restarted.attachments()] == ["t.r1.0000", "t.r2.0000"]
        assert (node_network.state_dir / "ruleset.nft").read_text() == before
        mine = {g1.ifname, g2.ifname}
        assert set(world.links()) == mine | {f"netns:{n}" for n in mine}
        assert await nc_probe(g1.ifname, *host) is None
        assert await nc_probe(g1.ifname, "169.254.169.254", 80) is None
        assert await nc_probe(g2.ifname, world.a, 80) == "internet-a"
        await restarted.start()  # idempotent
        assert (node_network.state_dir / "ruleset.nft").read_text() == before
    finally:
        await node_network.start()  # the session's instance re-reads the records
        await node_network.detach("t.r1.0000")
        await node_network.detach("t.r2.0000")


async def test_50_create_delete_cycles_leave_no_interface_and_no_rule(
    world: World, node_network: NodeNetwork, tmp_path: Path
) -> None:
    async def cycle(i: int) -> None:
        layers = (DEFAULT_LAYER, EgressLayer("vm", "allowlist", (Allow(f"{world.a}/32", TCP80),)))
        g = await _attach(node_network, tmp_path, f"c{i}", layers)
        assert g.ifname in world.links()
        await node_network.detach(f"t.c{i}.0000")

    assert node_network.attachments() == []
    for batch in range(10):  # 5 at a time, 50 in all
        await asyncio.gather(*(cycle(batch * 5 + k) for k in range(5)))
    assert node_network.attachments() == []
    assert world.links() == []
    table = world.nft_table()
    assert table["map_elements"] == []
    assert not [c for c in table["chains"] if str(c).startswith("vm-")]
    assert (node_network.state_dir / "ruleset.nft").read_text() == render(node_network.config, [])
    assert not list(node_network.state_dir.glob("t.c*.json"))


async def test_a_full_subnet_fails_the_attach_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = NetConfig(table="ivtfull", ifprefix="ivfull", subnet=pick_subnet(GUEST_RANGES, 28))
    nn = NodeNetwork(cfg, tmp_path / "net")
    await nn.start()
    try:
        for i in range(cfg.slots):
            await _attach(nn, tmp_path, f"f{i}")
        with pytest.raises(NetworkError, match="no free address"):
            await _attach(nn, tmp_path, "one-too-many")
        assert len(nn.attachments()) == cfg.slots == 4
    finally:
        await nn.teardown()
    assert await nn.interfaces() == set() and nn.namespaces() == set()
    assert sh("nft", "list", "table", "inet", "ivtfull", check=False).returncode != 0
