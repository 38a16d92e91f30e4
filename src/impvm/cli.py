"""The ``impvm`` command (DESIGN.md, fixed interfaces: CLI)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from impvm import __version__
from impvm.sim.cli import simulate_app

app = typer.Typer(
    name="impvm",
    help="Ephemeral GitHub Actions runners, one microVM per job, on Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    # rich tracebacks print local variables, which may hold credentials: plain tracebacks only
    pretty_exceptions_enable=False,
)
dev_app = typer.Typer(help="The embedded local stack.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
app.add_typer(simulate_app, name="simulate")


def _not_available(what: str, issue: str) -> None:
    """Exit 2 with a clear message for a subcommand a later issue delivers (no fake behaviour)."""
    typer.echo(f"impvm {what}: not available yet ({issue}).", err=True)
    raise typer.Exit(code=2)


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


@app.command()
def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch only these namespaces (default: all)."),
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
        float, typer.Option(help="Seconds past an agent Lease's expiry before its VMs are lost.")
    ] = 60.0,
) -> None:
    """Run the operator (pool controller, webhook receiver, reaper). Kubernetes credentials:
    KUBECONFIG or in-cluster."""
    from impvm.operator.context import OperatorSettings
    from impvm.operator.main import main as operator_main

    settings = OperatorSettings(
        github_api_url=github_api_url, node_lost_grace_seconds=node_lost_grace_seconds
    )
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
    cosign: Annotated[
        str,
        typer.Option(
            envvar="IMPVM_COSIGN",
            help="cosign binary that verifies image signatures (templates with spec.verify).",
        ),
    ] = "cosign",
) -> None:
    """Run the node agent: claim ImpVMs for this node and run them."""
    import os

    from impvm.agent.main import default_node_name, host_memory_mib
    from impvm.agent.main import main as agent_main

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
        cosign,
    )


@app.command("github-standin")
def github_standin(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
) -> None:
    """Serve the GitHub stand-in (a faithful GitHub API for tests and the embedded stack)."""
    try:
        from impvm.devstack import standin
    except ImportError:
        _not_available("github-standin", "arrives with the GitHub integration issue")
    standin.serve(host=host, port=port)


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
    """Start the embedded stack: control plane + CRDs, GitHub stand-in, registry with test
    images, operator, one agent, and the seed's minimal example; show VMs and runners live."""
    from impvm.devstack.up import run

    raise typer.Exit(
        code=run(
            runtime=runtime, jobs=jobs, until_done=until_done, workdir=workdir, timeout=timeout
        )
    )


if __name__ == "__main__":  # pragma: no cover
    app()
