"""What a person on call runs: ``impvm status`` (the cluster at a glance), ``impvm logs`` (a
VM's console) and ``impvm doctor`` (can this host run VMs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from impvm.cli.common import one_line, transport_errors


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
    except transport_errors() as e:
        typer.echo(f"impvm status: the API server cannot be reached: {one_line(e)}", err=True)
        raise typer.Exit(code=2) from None
    raise typer.Exit(code=code)


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
    except transport_errors() as e:
        typer.echo(f"impvm logs: the API server cannot be reached: {one_line(e)}", err=True)
        raise typer.Exit(code=2) from None
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


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
