"""The ``impvm`` command (docs/architecture.md, fixed interfaces: CLI)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from impvm import __version__
from impvm.images.cli import images_app
from impvm.scaling.settings import OperatorTunables
from impvm.sim.cli import simulate_app

app = typer.Typer(
    name="impvm",
    help="Ephemeral GitHub Actions runners, one microVM per job, on Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    # rich tracebacks print local variables, which may hold credentials: plain tracebacks only
    pretty_exceptions_enable=False,
    # click's plain help: typer's rich help shows every flag as taking a value (`--version
    # <bool>`)
    rich_markup_mode=None,
)
dev_app = typer.Typer(help="The embedded local stack.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(dev_app, name="dev")
app.add_typer(simulate_app, name="simulate")
app.add_typer(images_app, name="images")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"impvm {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print version."),
    ] = False,
) -> None:
    """impvm: operator, node agent and tools."""


@app.command()
def crds() -> None:
    """Print the imp.dev/v1alpha1 CustomResourceDefinitions as YAML."""
    from impvm.api.crd import render_yaml

    sys.stdout.write(render_yaml())


def _finite(value: float) -> float:
    """Refuse inf and nan (a range check lets them through: nan compares false)."""
    import math

    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _default(name: str) -> float:
    """The default of an operator tunable (:class:`impvm.scaling.settings.OperatorTunables`,
    also the defaults of ``impvm up``'s configuration)."""
    value = OperatorTunables.model_fields[name].default
    assert isinstance(value, float)
    return value


def _help(name: str) -> str:
    return OperatorTunables.model_fields[name].description or ""


def _require_kubeconfig(command: str) -> None:
    """Exit 2 with one line when lightkube's discovery (in-cluster ServiceAccount, then
    KUBECONFIG, then ~/.kube/config) finds no usable configuration: the components would
    otherwise die with a traceback."""
    from lightkube import ConfigError

    from impvm.commands.status import client

    try:
        client()  # reads the files the kubeconfig names, as the component will
    except ConfigError as e:
        typer.echo(f"impvm {command}: no usable kubeconfig: {e}", err=True)
        raise typer.Exit(code=2) from None


@app.command()
def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            "-n",
            metavar="NAMESPACE",
            help="Watch only this namespace; repeat for more (default: all).",
        ),
    ] = None,
    http_host: Annotated[str, typer.Option(help="Address of /healthz, /metrics, webhooks.")] = (
        "0.0.0.0"  # noqa: S104 - a cluster service listens on all interfaces
    ),
    http_port: Annotated[int, typer.Option(help="Port of the HTTP endpoint.")] = 8080,
    github_api_url: Annotated[
        str | None,
        typer.Option(help="Override the GitHub REST base URL (e.g. the GitHub stand-in)."),
    ] = None,
    node_lost_grace_seconds: Annotated[
        float, typer.Option(min=0.0, callback=_finite, help=_help("node_lost_grace_seconds"))
    ] = _default("node_lost_grace_seconds"),
    webhook_safety_poll_seconds: Annotated[
        float,
        typer.Option(min=5.0, callback=_finite, help=_help("webhook_safety_poll_seconds")),
    ] = _default("webhook_safety_poll_seconds"),
    poll_calls_per_hour: Annotated[
        float, typer.Option(min=60.0, callback=_finite, help=_help("poll_calls_per_hour"))
    ] = _default("poll_calls_per_hour"),
    poll_rate_limit_share: Annotated[
        float,
        typer.Option(min=0.01, max=1.0, callback=_finite, help=_help("poll_rate_limit_share")),
    ] = _default("poll_rate_limit_share"),
    leader_elect: Annotated[
        bool,
        typer.Option(
            help="Elect a leader on the Lease impvm-operator in --lease-namespace: only the "
            "leader reconciles, so several replicas may run."
        ),
    ] = True,
    lease_namespace: Annotated[
        str,
        typer.Option(
            help="Namespace of the leader Lease and of the agents' Leases: the installation's "
            "own (the chart passes its release namespace). Agent Leases elsewhere are never "
            "read; one Lease, one leader: never two operators on one cluster."
        ),
    ] = "impvm-system",
    leader_lease_seconds: Annotated[
        float,
        typer.Option(
            min=3.0,
            help="Seconds a leader's Lease is honoured without renewal (it stops after 2/3 "
            "of it; a standby takes over after all of it).",
        ),
    ] = 15.0,
    advertise_url: Annotated[
        str,
        typer.Option(
            envvar="IMPVM_ADVERTISE_URL",
            help="URL of this replica's HTTP endpoint as the other replicas reach it (e.g. "
            "http://$(POD_IP):8080); standbys forward webhook deliveries there.",
        ),
    ] = "",
    agent_service_account: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAMESPACE/NAME",
            help="ServiceAccount of the node agents, the only callers handed JIT configs; "
            "repeat for more (default: impvm-system/impvm-agent).",
        ),
    ] = None,
) -> None:
    """Run the operator (pool controller, webhook receiver, reaper). Kubernetes credentials:
    KUBECONFIG or in-cluster."""
    from impvm.operator.context import OperatorSettings
    from impvm.operator.main import main as operator_main
    from impvm.scaling.settings import PassSettings

    settings = OperatorSettings(
        pool=PassSettings(
            node_lost_grace_seconds=node_lost_grace_seconds,
            webhook_safety_poll_seconds=webhook_safety_poll_seconds,
            poll_calls_per_hour=poll_calls_per_hour,
            poll_rate_limit_share=poll_rate_limit_share,
        ),
        github_api_url=github_api_url,
        leader_elect=leader_elect,
        lease_namespace=lease_namespace,
        leader_lease_seconds=leader_lease_seconds,
        advertise_url=advertise_url,
    )
    if agent_service_account:
        users = []
        for sa in agent_service_account:
            ns, sep, name = sa.partition("/")
            if not sep or not ns or not name or "/" in name:
                raise typer.BadParameter(
                    f"{sa!r} is not NAMESPACE/NAME", param_hint="--agent-service-account"
                )
            users.append(f"system:serviceaccount:{ns}:{name}")
        settings = replace(settings, agent_service_accounts=tuple(users))
    _require_kubeconfig("operator")
    operator_main(namespace or [], http_host, http_port, settings)


@app.command()
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
    from impvm.agent.network.ruleset import NetConfigError

    try:
        static = from_settings(
            node_cidr or [], pod_cidr or [], service_cidr or [], cluster_dns or []
        )
    except NetConfigError as exc:
        typer.echo(f"impvm agent: {exc}", err=True)
        raise typer.Exit(code=2) from None
    _require_kubeconfig("agent")
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


@app.command("github-standin")
def github_standin(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
) -> None:
    """Serve the GitHub stand-in (a faithful GitHub API for tests and the embedded stack)."""
    from impvm.devstack import standin

    standin.serve(host=host, port=port)


@app.command()
def up(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="The configuration file (impvm.yaml).")
    ],
) -> None:
    """Run impvm on this machine: the embedded control plane (state in the configuration's
    dataDir), the operator and one agent, with the configuration's GitHub App and pools.
    Runs until SIGTERM/SIGINT; a configuration error prints one line and exits 2."""
    from impvm.up.main import run

    raise typer.Exit(code=run(config))


@app.command()
def status(
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Only this namespace (default: all).")
    ] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="table or json.")] = "table",
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws (--watch).")] = 2.0,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)."),
    ] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context.")] = None,
) -> None:
    """What a person on call looks at first: pools and their conditions, VMs by phase and node,
    agents (capacity, heartbeat, preflight), the GitHub rate limit, the last warning Events."""
    import asyncio

    from lightkube import ConfigError
    from rich.console import Console

    from impvm.commands.status import client, run

    if output not in ("table", "json"):
        typer.echo(f"impvm status: --output {output!r}: want table or json", err=True)
        raise typer.Exit(code=2)
    try:
        kube = client(kubeconfig, context)
    except ConfigError as e:
        typer.echo(f"impvm status: no usable kubeconfig: {e}", err=True)
        raise typer.Exit(code=2) from None

    console = Console()
    if not console.is_terminal:  # piped: long lines, like kubectl, not wrapped at 80 columns
        console = Console(width=240)

    async def main() -> int:
        try:
            return await run(
                kube,
                console,
                namespace=namespace,
                output=output,
                watch=watch,
                interval=interval,
            )
        finally:
            await kube.close()

    try:
        code = asyncio.run(main())
    except KeyboardInterrupt:
        code = 0
    except _transport_errors() as e:
        typer.echo(f"impvm status: the API server cannot be reached: {_one_line(e)}", err=True)
        raise typer.Exit(code=2) from None
    raise typer.Exit(code=code)


def _one_line(e: BaseException) -> str:
    """An error as one line (a YAML parser's message spans several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What lightkube's HTTP client raises when the API server cannot be reached."""
    import httpx2

    return (httpx2.TransportError, OSError)


@app.command()
def logs(
    vm: Annotated[str, typer.Argument(help="The ImpVM's name.")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Its namespace.")] = (
        "default"
    ),
    kubeconfig: Annotated[
        Path | None,
        typer.Option(help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)."),
    ] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context.")] = None,
) -> None:
    """Print a VM's console: the copy kept when it failed (also after the VM is deleted), or
    the live console of a running VM. Reads the file on this machine (impvm up's node)."""
    import asyncio
    import sys

    from lightkube import ConfigError

    from impvm.commands.logs import LogsError, locate, read
    from impvm.commands.status import client

    try:
        kube = client(kubeconfig, context)
    except ConfigError as e:
        typer.echo(f"impvm logs: no usable kubeconfig: {e}", err=True)
        raise typer.Exit(code=2) from None

    async def main() -> bytes:
        try:
            return read(await locate(kube, namespace, vm))
        finally:
            await kube.close()

    try:
        data = asyncio.run(main())
    except LogsError as e:
        typer.echo(f"impvm logs: {e}", err=True)
        raise typer.Exit(code=1) from None
    except _transport_errors() as e:
        typer.echo(f"impvm logs: the API server cannot be reached: {_one_line(e)}", err=True)
        raise typer.Exit(code=2) from None
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


@app.command()
def doctor(
    runtime: Annotated[str, typer.Option(help="VM runtime to check: qemu or process.")] = "qemu",
    workdir: Annotated[Path, typer.Option(help="The agent's state directory.")] = Path(
        "/var/lib/impvm"
    ),
    qemu_kernel: Annotated[
        Path | None, typer.Option(help="qemu runtime: guest kernel (default: newest usable).")
    ] = None,
    guest_network: Annotated[
        str, typer.Option(help="isolated (checks nftables) or unisolated (warns).")
    ] = "isolated",
    probe: Annotated[
        bool, typer.Option(help="qemu runtime: boot a probe guest (KVM, else TCG).")
    ] = True,
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
) -> None:
    """Check that this host can run VMs (the agent runs the same checks at start): tools and
    their versions, the guest kernel, /dev/kvm with a probe boot, free disk, namespaces, and
    nftables. One line per check; a failed one says what to install or fix. Exit 1 when a
    required check failed."""
    import asyncio
    import json

    from impvm.agent import doctor as dr

    if runtime not in ("qemu", "process"):
        typer.echo(f"impvm doctor: --runtime {runtime!r}: want qemu or process", err=True)
        raise typer.Exit(code=2)
    if output not in ("text", "json"):
        typer.echo(f"impvm doctor: --output {output!r}: want text or json", err=True)
        raise typer.Exit(code=2)
    checks = asyncio.run(
        dr.run_checks(
            runtime, workdir, qemu_kernel=qemu_kernel, guest_network=guest_network, probe=probe
        )
    )
    if output == "json":
        typer.echo(json.dumps(dr.as_dicts(checks), indent=2))
    else:
        for line in dr.lines(checks):
            typer.echo(line)
    verdict = dr.verdict(checks)
    if output != "json":
        typer.echo("ready: this host can run VMs" if verdict.ok else "not ready")
    raise typer.Exit(code=0 if verdict.ok else 1)


@dev_app.command("up")
def dev_up(
    runtime: Annotated[str, typer.Option(help="VM runtime: process or qemu.")] = "process",
    jobs: Annotated[int, typer.Option(help="Queue N matching jobs.")] = 0,
    until_done: Annotated[
        bool, typer.Option("--until-done", help="Exit 0 once the jobs ran; non-zero on timeout.")
    ] = False,
    workdir: Annotated[
        str | None, typer.Option(help="Directory for state (default: a temporary directory).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds --until-done waits.")] = 900.0,
) -> None:
    """impvm up with a generated configuration: the GitHub stand-in, a registry with test
    images and the minimal example as the pool; show VMs and runners live."""
    from impvm.devstack.up import run

    raise typer.Exit(
        code=run(
            runtime=runtime, jobs=jobs, until_done=until_done, workdir=workdir, timeout=timeout
        )
    )


if __name__ == "__main__":  # pragma: no cover
    app()
