"""``impvm operator``: run the operator (pool controller, webhook receiver, reaper)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from impvm.cli.common import finite, require_kubeconfig, tunable_default, tunable_help

if TYPE_CHECKING:
    from impvm.scaling.settings import VMPodSettings


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
        float, typer.Option(min=0.0, callback=finite, help=tunable_help("node_lost_grace_seconds"))
    ] = tunable_default("node_lost_grace_seconds"),
    webhook_safety_poll_seconds: Annotated[
        float,
        typer.Option(min=5.0, callback=finite, help=tunable_help("webhook_safety_poll_seconds")),
    ] = tunable_default("webhook_safety_poll_seconds"),
    poll_calls_per_hour: Annotated[
        float, typer.Option(min=60.0, callback=finite, help=tunable_help("poll_calls_per_hour"))
    ] = tunable_default("poll_calls_per_hour"),
    poll_rate_limit_share: Annotated[
        float,
        typer.Option(
            min=0.01, max=1.0, callback=finite, help=tunable_help("poll_rate_limit_share")
        ),
    ] = tunable_default("poll_rate_limit_share"),
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
    vm_pods: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Place VMs through the Kubernetes scheduler: a JSON file of what each VM pod "
            "is made with (image, overheadMiB, nodeSelectors, tolerations; the chart writes "
            "it). Without it the operator places VMs itself (clusters without a scheduler).",
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
    if vm_pods is not None:
        settings = replace(settings, vm_pods=load_vm_pods(vm_pods))
    require_kubeconfig("operator")
    operator_main(namespace or [], http_host, http_port, settings)


def load_vm_pods(path: Path) -> VMPodSettings:
    """The ``--vm-pods`` file; a file that cannot be read or that the model refuses is a usage
    error (exit 2) naming the field."""
    from pydantic import ValidationError

    from impvm.scaling.settings import VMPodSettings

    try:
        return VMPodSettings.model_validate_json(path.read_bytes())
    except OSError as e:
        raise typer.BadParameter(f"{path}: {e.strerror}", param_hint="--vm-pods") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(the file)"
        raise typer.BadParameter(f"{path}: {where}: {err['msg']}", param_hint="--vm-pods") from None
