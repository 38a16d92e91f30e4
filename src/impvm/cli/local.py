"""Running impvm on one machine: ``impvm up`` (the single-machine service), ``impvm dev up``
(the same with a generated configuration and the stand-ins) and ``impvm github-standin``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


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


def github_standin(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
) -> None:
    """Serve the GitHub stand-in (a faithful GitHub API for tests and the embedded stack)."""
    from impvm.devstack import standin

    standin.serve(host=host, port=port)
