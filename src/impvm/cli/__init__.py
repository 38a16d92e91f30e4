"""The ``impvm`` command (docs/architecture.md, fixed interfaces: CLI): the root ``app`` and
the commands of the modules beside this one, registered here in the order ``impvm --help``
lists them. Each command imports what it runs inside its function: ``impvm --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from impvm import __version__
from impvm.cli.agent_command import agent
from impvm.cli.local import dev_up, github_standin, up
from impvm.cli.oncall import doctor, logs, status
from impvm.cli.operator_command import operator
from impvm.images.cli import images_app
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


app.command()(operator)
app.command()(agent)
app.command("github-standin")(github_standin)
app.command()(up)
app.command()(status)
app.command()(logs)
app.command()(doctor)
dev_app.command("up")(dev_up)

__all__ = ["app"]
