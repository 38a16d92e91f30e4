"""What several ``impvm`` commands share: the operator tunables' defaults and help, finite
numbers, and the one-line exits for a missing kubeconfig or an unreachable API server."""

from __future__ import annotations

import typer

from impvm.scaling.settings import OperatorTunables


def finite(value: float) -> float:
    """Refuse inf and nan (a range check lets them through: nan compares false)."""
    import math

    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def tunable_default(name: str) -> float:
    """The default of an operator tunable (:class:`impvm.scaling.settings.OperatorTunables`,
    also the defaults of ``impvm up``'s configuration)."""
    value = OperatorTunables.model_fields[name].default
    assert isinstance(value, float)
    return value


def tunable_help(name: str) -> str:
    return OperatorTunables.model_fields[name].description or ""


def require_kubeconfig(command: str) -> None:
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


def one_line(e: BaseException) -> str:
    """An error as one line (a YAML parser's message spans several)."""
    return " ".join(str(e).split()) or type(e).__name__


def transport_errors() -> tuple[type[BaseException], ...]:
    """What lightkube's HTTP client raises when the API server cannot be reached."""
    import httpx2

    return (httpx2.TransportError, OSError)
