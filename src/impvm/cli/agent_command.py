"""``impvm agent``: run the node agent on this node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from impvm.cli.common import require_kubeconfig


def agent(
    node_name: Annotated[
        str | None, typer.Option(help="Node name (default: $NODE_NAME or the host name).")
    ] = None,
    runtime: Annotated[str, typer.Option(help="VM runtime: process or qemu.")] = "process",
    vcpu: Annotated[int | None, typer.Option(help="vCPUs offered (default: all).")] = None,
    memory_mib: Annotated[
        int | None, typer.Option(help="Memory offered in MiB (default: all).")
    ] = None,
    workdir: Annotated[Path, typer.Option(help="State directory (images, VMs).")] = Path(
        "/var/lib/impvm"
    ),
    image_cache_mib: Annotated[int, typer.Option(help="Image cache cap in MiB.")] = 10240,
    insecure_registry: Annotated[
        list[str] | None, typer.Option(help="Loopback registry host:port reached without TLS.")
    ] = None,
    bind_ro: Annotated[
        list[Path] | None,
        typer.Option(help="Host path bound read-only into process-runtime sandboxes (dev only)."),
    ] = None,
    lease_namespace: Annotated[str, typer.Option(help="Namespace of agent Leases.")] = (
        "impvm-system"
    ),
    qemu_kernel: Annotated[
        Path | None,
        typer.Option(help="qemu runtime: guest kernel (default: newest usable /boot/vmlinuz-*)."),
    ] = None,
    qemu_accelerator: Annotated[
        str, typer.Option(help="qemu runtime: auto (probe KVM, else TCG), kvm or tcg.")
    ] = "auto",
    guest_network: Annotated[
        str,
        typer.Option(
            help="isolated: each VM its own interface, NAT and egress policy (root, nftables); "
            "unisolated: VMs share this host's network, no isolation at all (development only)."
        ),
    ] = "isolated",
    guest_subnet: Annotated[
        str, typer.Option(help="IPv4 subnet the VMs' addresses come from (/16 to /28).")
    ] = "10.213.0.0/16",
    guest_dns: Annotated[
        list[str] | None,
        typer.Option(
            help="Resolver for VMs, repeatable (default: the upstream ones of --guest-dns-from, "
            "never the cluster's; 'none': none)."
        ),
    ] = None,
    guest_dns_from: Annotated[
        list[Path] | None,
        typer.Option(
            help="resolv.conf whose resolvers VMs get, repeatable: the first naming one wins "
            "(default: /etc/resolv.conf, then systemd-resolved's; in a pod, mount the node's)."
        ),
    ] = None,
    node_cidr: Annotated[
        list[str] | None,
        typer.Option(
            help="Node addresses (IP or CIDR) no VM reaches unless its policy names them, "
            "repeatable; added to what the pod (HOST_IPS) and the Nodes tell."
        ),
    ] = None,
    pod_cidr: Annotated[
        list[str] | None,
        typer.Option(help="The cluster's pod network, repeatable (added to the Nodes' podCIDRs)."),
    ] = None,
    service_cidr: Annotated[
        list[str] | None,
        typer.Option(help="The cluster's service network, repeatable (added to ServiceCIDRs)."),
    ] = None,
    cluster_dns: Annotated[
        list[str] | None,
        typer.Option(help="The cluster's DNS service address, repeatable (added to a pod's)."),
    ] = None,
    detect_cluster_networks: Annotated[
        bool,
        typer.Option(
            help="Also keep VMs from what the pod and the API tell: the node's addresses, every "
            "Node's addresses and podCIDRs, ServiceCIDRs, the pod's own resolvers."
        ),
    ] = True,
    network_table: Annotated[
        str, typer.Option(help="nftables table (inet family) holding the VMs' rules.")
    ] = "impvm",
    network_prefix: Annotated[
        str, typer.Option(help="Name prefix of the VMs' interfaces (<prefix>-<slot>).")
    ] = "impvm",
    metrics_address: Annotated[
        str, typer.Option(help="HOST:PORT of GET /metrics and /healthz ('' : not served).")
    ] = "127.0.0.1:9464",
    cosign: Annotated[
        str,
        typer.Option(
            envvar="IMPVM_COSIGN",
            help="cosign binary that verifies image signatures (templates with spec.verify).",
        ),
    ] = "cosign",
    operator_url: Annotated[
        str | None,
        typer.Option(
            envvar="IMPVM_OPERATOR_URL",
            help="Base URL of the operator, which hands out the VMs' JIT configs "
            "(e.g. http://impvm-operator.impvm-system:8080).",
        ),
    ] = None,
    token_file: Annotated[
        Path,
        typer.Option(
            help="Node-bound ServiceAccount token (audience impvm-operator) shown to the "
            "operator; read at every request.",
        ),
    ] = Path("/var/run/secrets/impvm/token"),
) -> None:
    """Run the node agent: run the ImpVMs the operator bound to this node."""
    import os

    from impvm.agent.main import default_node_name, host_memory_mib
    from impvm.agent.main import main as agent_main
    from impvm.agent.network.cluster import from_settings
    from impvm.agent.network.plan import NetConfigError

    try:
        static = from_settings(
            node_cidr or [], pod_cidr or [], service_cidr or [], cluster_dns or []
        )
    except NetConfigError as exc:
        typer.echo(f"impvm agent: {exc}", err=True)
        raise typer.Exit(code=2) from None
    require_kubeconfig("agent")
    agent_main(
        node_name or default_node_name(),
        runtime,
        vcpu or os.cpu_count() or 1,
        memory_mib or host_memory_mib(),
        workdir,
        image_cache_mib,
        insecure_registry or [],
        bind_ro or [],
        lease_namespace,
        qemu_kernel,
        qemu_accelerator,
        guest_network,
        guest_subnet,
        guest_dns,
        network_table,
        network_prefix,
        metrics_address,
        cosign,
        operator_url,
        token_file,
        static,
        detect_cluster_networks,
        tuple(guest_dns_from or ()),
    )
