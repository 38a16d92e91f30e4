"""The agent learns the cluster's networks from the API and keeps them in its nftables table:
every Node's addresses and pod networks and every ServiceCIDR, on a real API server, in a real
table (the ``protected`` set), following Nodes that join and leave. An agent that may not read
them says so and keeps what its settings name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import NodeSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from impvm.agent.network.cluster import ClusterWatch, from_settings
from impvm.agent.network.node import NodeNetwork
from impvm.agent.network.plan import NetConfig
from impvm.devstack.netns import GUEST_RANGES, pick_subnet, run_token
from impvm.kube.admin import admin_client, service_account_kubeconfig
from impvm.kube.controlplane import ControlPlane

pytestmark = [pytest.mark.controlplane]


def protected_set(table: str) -> set[str]:
    """The elements of the table's ``protected`` set, as the kernel holds them."""
    out = subprocess.run(
        ["nft", "-j", "list", "set", "inet", table, "protected"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return set()
    (s,) = [i["set"] for i in json.loads(out.stdout)["nftables"] if "set" in i]
    got = set()
    for e in s.get("elem", []):
        if isinstance(e, str):
            got.add(f"{e}/32")
        elif "prefix" in e:
            got.add(f"{e['prefix']['addr']}/{e['prefix']['len']}")
        elif "range" in e:
            got.add("-".join(e["range"]))
    return got


@pytest_asyncio.fixture
async def network(tmp_path: Path) -> AsyncIterator[NodeNetwork]:
    token = run_token()
    cfg = NetConfig(
        table=f"ivk{token}", ifprefix=f"ik{token}", subnet=pick_subnet(GUEST_RANGES, 24)
    )
    nn = NodeNetwork(cfg, tmp_path / "net")
    await nn.start()
    try:
        yield nn
    finally:
        await nn.teardown()


async def until(what: str, check: object, seconds: float = 60) -> None:
    for _ in range(int(seconds * 10)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never: {what}")


async def test_nodes_and_service_cidrs_are_kept_from_guests_as_they_come_and_go(
    control_plane: ControlPlane, network: NodeNetwork
) -> None:
    kube = admin_client(control_plane.kubeconfig)
    names = [f"cn-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    kube.create(Node(metadata=ObjectMeta(name=names[0]), spec=NodeSpec(podCIDRs=["10.244.7.0/24"])))
    kube.patch(
        Node.Status,
        names[0],
        {"status": {"addresses": [
            {"type": "InternalIP", "address": "10.0.7.4"},
            {"type": "ExternalIP", "address": "198.51.100.74"},
            {"type": "Hostname", "address": names[0]},
        ]}},
        patch_type=PatchType.MERGE,
    )  # fmt: skip
    client = AsyncClient(config=KubeConfig.from_file(str(control_plane.kubeconfig)))
    static = from_settings(nodes=["192.0.2.0/29"])
    watch = ClusterWatch(client, network, static)
    table = network.config.table
    try:
        await watch.start()
        # the test control plane's service range (--service-cluster-ip-range), as ServiceCIDR
        want = {"10.0.0.0/24", "10.244.7.0/24", "10.0.7.4/32", "198.51.100.74/32", "192.0.2.0/29"}
        assert want <= protected_set(table), protected_set(table)
        # a node joins: kept from guests; it leaves: no longer
        kube.create(
            Node(metadata=ObjectMeta(name=names[1]), spec=NodeSpec(podCIDRs=["10.244.9.0/24"]))
        )
        await until("the new node's pod network is in the table",
                    lambda: "10.244.9.0/24" in protected_set(table))  # fmt: skip
        kube.delete(Node, names[1])
        await until("the gone node's pod network left the table",
                    lambda: "10.244.9.0/24" not in protected_set(table))  # fmt: skip
        assert want <= protected_set(table)
    finally:
        await watch.close()
        await client.close()
        for n in names:
            with contextlib.suppress(ApiError):  # the second is gone already
                kube.delete(Node, n)


async def test_an_agent_that_may_not_read_them_keeps_what_its_settings_name(
    control_plane: ControlPlane, network: NodeNetwork, tmp_path: Path
) -> None:
    """A ServiceAccount without the agent's role: listing Nodes and ServiceCIDRs is refused;
    the watch gives up after its wait, warns, and the table holds the settings' networks."""
    kube = admin_client(control_plane.kubeconfig)
    cfg = service_account_kubeconfig(kube, control_plane.kubeconfig, "default", "no-rights")
    client = AsyncClient(config=KubeConfig.from_dict(cfg))
    watch = ClusterWatch(client, network, from_settings(pods=["10.244.0.0/16"]), sync_seconds=2)
    try:
        await watch.start()
        assert protected_set(network.config.table) == {"10.244.0.0/16"}
    finally:
        await watch.close()
        await client.close()


async def test_setting_the_same_networks_again_changes_nothing(network: NodeNetwork) -> None:
    ruleset = network.state_dir / "ruleset.nft"
    assert await network.set_protected(("10.96.0.0/12", "10.96.0.10/32"))
    first = ruleset.read_text()
    for _ in range(2):
        assert not await network.set_protected(("10.96.0.0/12",))  # the same, collapsed
    assert ruleset.read_text() == first
    assert protected_set(network.config.table) == {"10.96.0.0/12"}
