"""The ``impvm`` command (DESIGN.md, fixed interfaces: CLI)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from impvm import __version__

app = typer.Typer(
    name="impvm",
    help="Ephemeral GitHub Actions runners, one microVM per job, on Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
)
dev_app = typer.Typer(help="The embedded local stack.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


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
def operator() -> None:
    """Run the operator (pool controller, demand, reaper)."""
    _not_available("operator", "arrives with the pool controller issue")


@app.command()
def agent() -> None:
    """Run the node agent."""
    _not_available("agent", "arrives with the node agent issue")


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
) -> None:
    """Start the embedded stack: control plane with CRDs installed (more arrives with later
    issues)."""
    from impvm.devstack.up import run

    raise typer.Exit(code=run(runtime=runtime, jobs=jobs, until_done=until_done, workdir=workdir))


if __name__ == "__main__":  # pragma: no cover
    app()
