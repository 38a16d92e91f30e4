"""The agent's network side as the chart runs it, inside a namespace that plays its pod: run by
tests/network/test_chart_network.py with ``ip netns exec <pod> python -m
tests.network.chart_harness CONFIG``.

It does what ``impvm agent`` does at start with the chart's arguments, with the agent's own
functions: the protected networks from the chart's values and from the pod (``HOST_IPS``, the
``kubernetes`` Service, the pod's ClusterFirst resolv.conf, which ``ip netns exec`` shows from
``/etc/netns/<pod>/resolv.conf``), the guests' resolvers from the node's resolv.conf
(``--guest-dns-from``), then :class:`NodeNetwork` in this namespace and a runtime (process or
qemu) that starts the probe VMs. It prints one JSON line once they run, and cleans up when its
stdin closes. (The API watch of Nodes and ServiceCIDRs is tested against a real API server in
tests/network/test_cluster_networks.py.)

Only image pulls leave the pod's namespace: skopeo runs in the test's own namespace (a wrapper
on PATH), where the loopback registry is.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from pathlib import Path
from typing import Any

from impvm.agent.images import ImageStore
from impvm.agent.main import cluster_ranges, make_network
from impvm.agent.network.cluster import from_settings
from impvm.agent.network.node import NodeNetwork
from impvm.agent.network.policy import EgressLayer
from impvm.agent.process import ProcessRuntime
from impvm.agent.qemu import QemuRuntime
from impvm.agent.runtime import Runtime, Secret
from tests.network.probe import probe_request


async def main(config: dict[str, Any]) -> None:
    work = Path(config["workdir"])
    static = from_settings(pods=config["pod_cidrs"], services=config["service_cidrs"])
    network = make_network(
        work,
        "isolated",
        config["subnet"],
        None,  # agent.network.dns empty: the node's resolvers
        config["table"],
        config["prefix"],
        cluster_ranges(static),
        (Path(config["node_resolv_conf"]),),
    )
    assert isinstance(network, NodeNetwork)
    await network.start()
    store = ImageStore(Path(config["store"]), 1 << 30, set(config["insecure"]))
    rt: Runtime
    if config["runtime"] == "qemu":
        boot = await asyncio.to_thread(Path(config["qemu"]).read_bytes)
        kernel, initramfs, accel = pickle.loads(boot)
        rt = QemuRuntime(
            store,
            kernel=kernel,
            initramfs=initramfs,
            accel=accel,
            state_dir=work / "qemu",
            network=network,
        )
    else:
        rt = ProcessRuntime(store, network=network)
    reqs = [
        probe_request(
            work,
            vm["name"],
            (vm["image"], vm["layer"]),
            tuple(EgressLayer.from_json(x) for x in vm["layers"]),
        )
        for vm in config["vms"]
    ]
    try:
        for req, vm in zip(reqs, config["vms"], strict=True):
            await rt.start(req, Secret(vm["jit"]))
        ready = {
            "dns": list(network.config.reachable_dns),
            "protected": list(network.config.protected),
            "gateways": [network.config.gateway(a.slot) for a in network.attachments()],
        }
        print(json.dumps(ready), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test closes it
    finally:
        for req in reqs:
            await rt.cleanup(req)
        await network.teardown()


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
