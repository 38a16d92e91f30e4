"""What no guest reaches unless its policy names it: the node's addresses and the cluster's own
networks, learnt from the agent's settings, from the pod it runs in, and from the API.

Guests leave through the agent's network namespace. In a DaemonSet pod (the chart) that way out
runs through the node, where the node's addresses (kubelet on 10250, sshd, NodePorts) and the
cluster's pod and service networks are ordinary forwarded destinations: the ``input`` chain,
which rejects guest traffic to the pod's own addresses, never sees them. They make up the
*protected* networks (``NetConfig.protected``, see :mod:`impvm.agent.network.ruleset`), from:

* the settings: ``impvm agent --node-cidr/--pod-cidr/--service-cidr/--cluster-dns`` (the
  chart's ``agent.network.cluster`` values);
* the pod, when the agent runs in one (``KUBERNETES_SERVICE_HOST`` is set, as the kubelet does in
  every container): ``HOST_IPS`` (the downward API's ``status.hostIPs``, comma-separated), the
  ``kubernetes`` Service's address, and the pod's own resolvers (``dnsPolicy: ClusterFirst``:
  the cluster's DNS service);
* the API, watched by :class:`ClusterWatch`: every Node's ``status.addresses`` (InternalIP,
  ExternalIP) and ``spec.podCIDRs``, and every ServiceCIDR's ``spec.cidrs``
  (``networking.k8s.io/v1``, Kubernetes >= 1.33) - so a node that joins later is covered too.

An agent on the host itself (``impvm up``, systemd) has the node's own addresses locally:
``input`` rejects guest traffic to every one of them already.

IPv4 only, like the guests' egress. Everything here but :class:`ClusterWatch` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from lightkube.resources.networking_v1 import ServiceCIDR

from impvm.agent.network.node import NodeNetwork, parse_resolvers
from impvm.agent.network.plan import NetConfigError
from impvm.agent.network.policy import collapse
from impvm.kube.watchcache import Key, WatchCache

log = logging.getLogger("impvm.agent.network")

#: Node address types that reach the node (``Hostname``/``InternalDNS`` are names, not
#: addresses): Kubernetes API, NodeStatus.addresses
NODE_ADDRESS_TYPES = ("InternalIP", "ExternalIP")


def _v4(value: str) -> ipaddress.IPv4Network | None:
    """``value`` as an IPv4 network (an address is a /32), None for IPv6 or garbage."""
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        return None
    return net if isinstance(net, ipaddress.IPv4Network) else None


def parse_networks(values: Iterable[str], what: str) -> tuple[str, ...]:
    """IPv4 networks or addresses given by a person (a flag, a chart value), canonical. Raises
    :class:`NetConfigError` naming ``what`` and the bad entry."""
    out = []
    for v in values:
        try:
            out.append(str(ipaddress.IPv4Network(v.strip(), strict=False)))
        except ValueError:
            raise NetConfigError(f"{what} {v!r}: not an IPv4 address or CIDR") from None
    return tuple(out)


@dataclass(frozen=True)
class ClusterRanges:
    """The protected networks by where they come from (canonical IPv4 CIDRs): the nodes'
    addresses, the pods', the services', and the cluster's DNS servers."""

    nodes: tuple[str, ...] = ()
    pods: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()

    def union(self, *others: ClusterRanges) -> ClusterRanges:
        """These and ``others`` together (order kept, duplicates dropped)."""
        every = (self, *others)

        def join(field: str) -> tuple[str, ...]:
            return tuple(dict.fromkeys(c for r in every for c in getattr(r, field)))

        return ClusterRanges(join("nodes"), join("pods"), join("services"), join("dns"))

    def protected(self) -> tuple[str, ...]:
        """All of them, collapsed (``NetConfig.protected``)."""
        return collapse((*self.nodes, *self.pods, *self.services, *self.dns))

    def describe(self) -> str:
        """One line for the log."""
        parts = [
            f"{what} {', '.join(nets)}"
            for what, nets in (
                ("nodes", self.nodes),
                ("pods", self.pods),
                ("services", self.services),
                ("cluster DNS", self.dns),
            )
            if nets
        ]
        return "; ".join(parts) or "none"


def from_settings(
    nodes: Iterable[str] = (),
    pods: Iterable[str] = (),
    services: Iterable[str] = (),
    dns: Iterable[str] = (),
) -> ClusterRanges:
    """The networks the settings name (``--node-cidr``, ``--pod-cidr``, ``--service-cidr``,
    ``--cluster-dns``). Raises :class:`NetConfigError` naming the flag of a bad entry."""
    return ClusterRanges(
        parse_networks(nodes, "--node-cidr"),
        parse_networks(pods, "--pod-cidr"),
        parse_networks(services, "--service-cidr"),
        parse_networks(dns, "--cluster-dns"),
    )


def in_pod(env: Mapping[str, str]) -> bool:
    """Whether the agent runs in a Kubernetes pod (the kubelet sets the ``kubernetes`` Service's
    variables in every container)."""
    return bool(env.get("KUBERNETES_SERVICE_HOST"))


def from_pod(env: Mapping[str, str], resolv_conf: str) -> ClusterRanges:
    """What the pod the agent runs in tells (nothing outside a pod): the node's addresses
    (``HOST_IPS``, else ``HOST_IP``: the downward API's ``status.hostIPs``/``status.hostIP``),
    the ``kubernetes`` Service's address (``KUBERNETES_SERVICE_HOST``) and the resolvers of the
    pod's ``resolv_conf`` (ClusterFirst: the cluster's DNS). IPv6 entries are left out."""
    if not in_pod(env):
        return ClusterRanges()
    hosts = (env.get("HOST_IPS") or env.get("HOST_IP") or "").split(",")
    nodes = tuple(str(n) for n in map(_v4, hosts) if n is not None)
    service = _v4(env.get("KUBERNETES_SERVICE_HOST", ""))
    dns = tuple(f"{d}/32" for d in parse_resolvers(resolv_conf))
    return ClusterRanges(nodes=nodes, services=(str(service),) if service else (), dns=dns)


def from_node(raw: dict[str, Any]) -> ClusterRanges:
    """One Node object's addresses (InternalIP, ExternalIP) and pod networks, IPv4 only."""
    status = raw.get("status") or {}
    spec = raw.get("spec") or {}
    addrs = [
        a.get("address", "")
        for a in status.get("addresses") or []
        if a.get("type") in NODE_ADDRESS_TYPES
    ]
    pods = [*(spec.get("podCIDRs") or []), *([spec["podCIDR"]] if spec.get("podCIDR") else [])]
    return ClusterRanges(
        nodes=tuple(dict.fromkeys(str(n) for n in map(_v4, addrs) if n is not None)),
        pods=tuple(dict.fromkeys(str(n) for n in map(_v4, pods) if n is not None)),
    )


def from_service_cidr(raw: dict[str, Any]) -> ClusterRanges:
    """One ServiceCIDR object's IPv4 networks."""
    cidrs = (raw.get("spec") or {}).get("cidrs") or []
    return ClusterRanges(services=tuple(str(n) for n in map(_v4, cidrs) if n is not None))


def split_resolvers(
    resolvers: Iterable[str], protected: Iterable[str]
) -> tuple[list[str], list[str]]:
    """``resolvers`` as (usable by guests, inside the protected networks)."""
    nets = [ipaddress.IPv4Network(p) for p in protected]
    keep: list[str] = []
    drop: list[str] = []
    for r in resolvers:
        (drop if any(ipaddress.IPv4Address(r) in n for n in nets) else keep).append(r)
    return keep, drop


class ClusterWatch:
    """Keeps ``network``'s protected networks at ``static`` plus what the API says: every Node's
    addresses and pod networks, every ServiceCIDR (list + watch, :mod:`impvm.kube.watchcache`). The
    agent's ServiceAccount may list and watch both (deploy/rbac/agent.yaml). A kind it cannot
    read within ``sync_seconds`` (no permission, an API server without ServiceCIDRs) is given up
    with a warning that names the setting to use instead."""

    def __init__(
        self,
        client: AsyncClient,
        network: NodeNetwork,
        static: ClusterRanges,
        sync_seconds: float = 30.0,
    ) -> None:
        self.network = network
        self.static = static
        self.sync_seconds = sync_seconds
        self._changed = asyncio.Event()
        self.nodes: WatchCache[ClusterRanges] = WatchCache(
            client, Node, from_node, namespace=None, on_change=self._poke, name="nodes"
        )
        self.service_cidrs: WatchCache[ClusterRanges] = WatchCache(
            client,
            ServiceCIDR,
            from_service_cidr,
            namespace=None,
            on_change=self._poke,
            name="servicecidrs",
        )
        self._tasks: list[asyncio.Task[None]] = []

    def _poke(self, _key: Key) -> None:
        self._changed.set()

    def ranges(self) -> ClusterRanges:
        """``static`` and every cached Node and ServiceCIDR."""
        return self.static.union(*self.nodes.values(), *self.service_cidrs.values())

    async def start(self) -> None:
        """Start watching; return once both kinds were listed (or given up) and the table
        protects what they hold. Raises :class:`~impvm.agent.network.node.NetworkError` when
        the table cannot be applied."""
        hints = {"nodes": "--node-cidr and --pod-cidr", "servicecidrs": "--service-cidr"}
        for cache in (self.nodes, self.service_cidrs):
            task = asyncio.create_task(cache.run(), name=f"watch {cache.name}")
            try:
                await asyncio.wait_for(cache.synced.wait(), self.sync_seconds)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                log.warning(
                    "cannot read the cluster's %s (see the warnings above): guests are kept "
                    "from only what the settings and the pod name; set %s",
                    cache.name,
                    hints[cache.name],
                )
                continue
            self._tasks.append(task)
        await self._apply()
        self._tasks.append(asyncio.create_task(self._follow(), name="cluster networks"))

    async def _apply(self) -> None:
        ranges = self.ranges()
        if await self.network.set_protected(ranges.protected()):
            log.info("cluster networks kept from guests: %s", ranges.describe())

    async def _follow(self) -> None:
        """Apply again after each change (a burst of changes is one apply); a failure is
        retried at the next change or after 10 s."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 10.0)
            self._changed.clear()
            try:
                await self._apply()
            except Exception as e:  # keep the last applied table; try again
                log.warning("updating the protected networks failed: %s", e)

    async def close(self) -> None:
        """Stop watching (the table keeps what it has)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


__all__ = [
    "NODE_ADDRESS_TYPES",
    "ClusterRanges",
    "ClusterWatch",
    "from_node",
    "from_pod",
    "from_service_cidr",
    "from_settings",
    "in_pod",
    "parse_networks",
    "split_resolvers",
]
