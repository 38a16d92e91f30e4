"""``impvm agent``: one node agent with its runtime."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from lightkube import AsyncClient

from impvm.agent import doctor
from impvm.agent.agent import Agent, AgentConfig
from impvm.agent.capacity import Resources
from impvm.agent.doctor import Check
from impvm.agent.images import ImageStore
from impvm.agent.jitsource import JitSource, OperatorJitSource
from impvm.agent.lifecycle import Preflight
from impvm.agent.network import UNISOLATED, UNISOLATED_WARNING, guest_network_error
from impvm.agent.network.cluster import (
    ClusterRanges,
    ClusterWatch,
    from_pod,
    in_pod,
    split_resolvers,
)
from impvm.agent.network.node import NetworkError, NodeNetwork, host_resolvers
from impvm.agent.network.plan import NetConfig, NetConfigError
from impvm.agent.process import ProcessRuntime
from impvm.agent.qemu import QemuRuntime, create_qemu_runtime
from impvm.agent.runtime import Runtime, VMRuntimeError
from impvm.telemetry import metrics_http

log = logging.getLogger("impvm.agent")

#: loopback: the node's VMs and other tenants cannot read it; a DaemonSet sets the pod address
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9464"


def default_node_name() -> str:
    """``NODE_NAME`` (set from the downward API in a DaemonSet), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def host_memory_mib() -> int:
    """Total memory of this host in MiB (from /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def make_runtime(
    name: str,
    workdir: Path,
    image_cache_bytes: int,
    insecure_registries: set[str],
    ro_binds: list[Path],
    qemu_kernel: Path | None = None,
    qemu_accelerator: str = "auto",
    network: NodeNetwork | None = None,
    cosign: str = "cosign",
) -> Runtime:
    """The runtime called ``name``: ``process`` (bubblewrap) or ``qemu`` (a VM per job; finds the
    kernel, builds the guest initramfs and probes the accelerator with real boots, which takes
    seconds). ``qemu_accelerator``: ``auto``, ``kvm`` or ``tcg``. Raises ``ValueError`` for an
    unknown or unavailable runtime (the message says why). ``network``: the node's guest networks
    (``None``: no isolation, development only). ``cosign``: the binary verifying signed images
    (run only for VMs whose spec has ``verify``)."""
    store = ImageStore(workdir / "images", image_cache_bytes, insecure_registries, cosign)
    if name == "process":
        return ProcessRuntime(store, extra_ro_binds=ro_binds, network=network)
    if name == "qemu":
        if qemu_accelerator not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accelerator {qemu_accelerator!r}: want auto, kvm or tcg")
        try:
            rt = asyncio.run(
                create_qemu_runtime(
                    store,
                    workdir / "qemu",
                    kernel=qemu_kernel,
                    accelerator=qemu_accelerator,  # type: ignore[arg-type]
                    extra_ro_binds=ro_binds,
                    network=network,
                )
            )
        except VMRuntimeError as exc:
            raise ValueError(f"runtime 'qemu' is not available: {exc}") from None
        log.info(
            "qemu runtime: kernel %s, accelerator %s (%s)",
            rt.kernel.path,
            rt.accel,
            rt.accel.reason,
        )
        return rt
    raise ValueError(f"runtime {name!r} is not available (known: process, qemu)")


#: where a pod's resolvers are (ClusterFirst: the cluster's DNS service)
POD_RESOLV_CONF = Path("/etc/resolv.conf")


def cluster_ranges(static: ClusterRanges, env: Mapping[str, str] | None = None) -> ClusterRanges:
    """The protected networks known at start: the settings' and, in a pod, what the pod
    tells (:func:`~impvm.agent.network.cluster.from_pod`: the node's addresses, the
    ``kubernetes`` Service, the pod's own resolvers as the cluster's DNS)."""
    env = os.environ if env is None else env
    if not in_pod(env):
        return static
    try:
        text = POD_RESOLV_CONF.read_text()
    except OSError:
        text = ""
    return static.union(from_pod(env, text))


def make_network(
    workdir: Path,
    mode: str,
    subnet: str,
    dns: list[str] | None,
    table: str,
    prefix: str,
    cluster: ClusterRanges | None = None,
    dns_from: tuple[Path, ...] = (),
) -> NodeNetwork | None:
    """The node's guest networks for ``mode`` ``isolated`` (``None`` for ``unisolated``: guests
    share the agent's network, development only; a warning is logged). ``cluster``: the
    networks no guest reaches unless its policy names them (:func:`cluster_ranges`). ``dns``:
    resolvers for guests (``None``: the upstream ones of ``dns_from``, resolv.conf files,
    default the node's own, :func:`host_resolvers`, leaving out any inside ``cluster`` - never
    the cluster's DNS; ``["none"]``: no resolver). Raises ``ValueError`` naming the bad
    setting: also a ``--guest-dns`` inside ``cluster``."""
    error = guest_network_error(mode, "--guest-network")
    if error is not None:
        raise ValueError(error)
    if mode == UNISOLATED:
        log.warning("--guest-network unisolated: %s", UNISOLATED_WARNING)
        return None
    cluster = cluster or ClusterRanges()
    protected = cluster.protected()
    if dns is None:
        found = host_resolvers(dns_from) if dns_from else host_resolvers()
        dns, dropped = split_resolvers(found, protected)
        if dropped:
            log.info("not for guests: %s (the cluster's, or the node's own)", ", ".join(dropped))
        if not dns:
            where = ", ".join(map(str, dns_from)) or "/etc/resolv.conf"
            log.warning("no resolver for guests found in %s; set --guest-dns", where)
    elif dns == ["none"]:
        dns = []
    else:
        _, inside = split_resolvers(dns, protected)
        if inside:
            raise ValueError(
                f"--guest-dns {inside[0]}: inside the cluster's or the node's networks "
                f"({cluster.describe()}), which guests must not reach; name an upstream resolver"
            )
    try:
        cfg = NetConfig(table=table, ifprefix=prefix, subnet=subnet, dns=tuple(dns),
                        protected=protected)  # fmt: skip
    except NetConfigError as exc:
        raise ValueError(str(exc)) from None
    log.info(
        "guest networks: subnet %s, table inet %s, resolvers %s; never reached unless a "
        "policy names them: %s", subnet, table, dns, cluster.describe(),
    )  # fmt: skip
    return NodeNetwork(cfg, workdir / "network")


async def run(
    config: AgentConfig,
    runtime: Runtime,
    jit: JitSource,
    network: NodeNetwork | None = None,
    metrics_address: tuple[str, int] | None = None,
    preflight: Preflight | None = None,
    cluster: ClusterRanges | None = None,
) -> None:
    """Run the agent until cancelled (credentials from KUBECONFIG or the ServiceAccount); first
    rebuild the node's guest networks from what is running and, with ``cluster`` (the
    networks known at start), keep the cluster's Nodes and ServiceCIDRs from guests too
    (:class:`ClusterWatch`) before any VM starts. ``jit``: where JIT configs come from.
    ``metrics_address``: where ``GET /metrics`` and ``GET /healthz`` are served (None: not
    served)."""
    kube = AsyncClient(field_manager="impvm-agent")
    watch = None
    if network is not None:
        await network.start()
        if cluster is not None:
            watch = ClusterWatch(kube, network, cluster)
            await watch.start()
    server = None
    if metrics_address is not None:
        try:
            server = await metrics_http.start(metrics_http.make_app(), *metrics_address)
        except OSError as exc:  # one line, like a bad option
            host, port = metrics_address
            raise SystemExit(
                f"impvm agent: --metrics-address {host}:{port}: {exc.strerror}"
            ) from None
        log.info("metrics on %s:%d", *metrics_address)
    try:
        await Agent(kube, runtime, config, preflight, jit=jit).run()
    finally:
        if watch is not None:
            await watch.close()
        await kube.close()
        await jit.close()
        if server is not None:
            await server.cleanup()


def main(
    node_name: str,
    runtime_name: str,
    vcpu: int,
    memory_mib: int,
    workdir: Path,
    image_cache_mib: int,
    insecure_registries: list[str],
    ro_binds: list[Path],
    lease_namespace: str,
    qemu_kernel: Path | None = None,
    qemu_accelerator: str = "auto",
    guest_network: str = "isolated",
    guest_subnet: str = "10.213.0.0/16",
    guest_dns: list[str] | None = None,
    network_table: str = "impvm",
    network_prefix: str = "impvm",
    metrics_address: str = DEFAULT_METRICS_ADDRESS,
    cosign: str = "cosign",
    operator_url: str | None = None,
    token_file: Path = Path("/var/run/secrets/impvm/token"),
    static_cluster: ClusterRanges | None = None,
    detect_cluster: bool = True,
    guest_dns_from: tuple[Path, ...] = (),
) -> None:
    """Blocking entry point of the CLI. ``metrics_address``: ``HOST:PORT`` of ``/metrics``, or
    ``""`` for none. ``static_cluster``: the protected networks the settings name;
    ``detect_cluster``: add what the pod and the API tell (:func:`cluster_ranges`,
    :class:`ClusterWatch`). ``guest_dns_from``: resolv.conf files the guests' resolvers come
    from (default: the node's)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not operator_url:
        print("impvm agent: --operator-url is required (the JIT config hand-out)", file=sys.stderr)
        raise SystemExit(2)
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        metrics_at = metrics_http.parse_address(metrics_address) if metrics_address else None
    except ValueError as exc:
        print(f"impvm agent: --metrics-address {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    static = static_cluster or ClusterRanges()
    cluster = cluster_ranges(static) if detect_cluster else static
    try:
        network = make_network(
            workdir,
            guest_network,
            guest_subnet,
            guest_dns,
            network_table,
            network_prefix,
            cluster,
            guest_dns_from,
        )
    except ValueError as exc:  # a bad option: one line naming it, exit 2
        print(f"impvm agent: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # the host preflight (impvm doctor): the qemu runtime probes its accelerator itself
    checks = asyncio.run(
        doctor.run_checks(
            runtime_name,
            workdir,
            qemu_kernel=qemu_kernel,
            guest_network=guest_network,
            probe=False,
        )
    )
    for line in doctor.lines(checks):
        log.info("preflight: %s", line)
    try:
        runtime: Runtime = make_runtime(
            runtime_name,
            workdir,
            image_cache_mib * 1024 * 1024,
            set(insecure_registries),
            ro_binds,
            qemu_kernel,
            qemu_accelerator,
            network,
            cosign,
        )
    except ValueError as exc:
        if runtime_name not in ("qemu", "process"):  # a bad option: one line naming it, exit 2
            print(f"impvm agent: --runtime {runtime_name!r}: want qemu or process", file=sys.stderr)
            raise SystemExit(2) from None
        # the runtime cannot work here: run anyway, admit no VM, say why on the Lease
        checks.append(Check(f"runtime {runtime_name}", False, str(exc), "see the checks above"))
        store = ImageStore(workdir / "images", image_cache_mib * 1024 * 1024, set())
        runtime = ProcessRuntime(store)
    preflight = doctor.verdict(checks)
    if not preflight.ok:
        log.error("preflight failed, this agent admits no VMs: %s", preflight.reason)
    config = AgentConfig(
        node_name=node_name,
        capacity=Resources(vcpu, memory_mib),
        workdir=workdir,
        lease_namespace=lease_namespace,
        accelerator=str(runtime.accel) if isinstance(runtime, QemuRuntime) else "none",
    )
    try:
        asyncio.run(
            run(
                config,
                runtime,
                OperatorJitSource(operator_url, token_file),
                network,
                metrics_at,
                preflight,
                cluster if detect_cluster else None,
            )
        )
    except NetworkError as exc:  # the node cannot isolate its VMs: do not run any
        raise SystemExit(f"impvm agent: guest networks: {exc}") from None
