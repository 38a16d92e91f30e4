"""``impvm status``: read one snapshot of the cluster and print it
(:mod:`impvm.commands.statusview`), once, as JSON, or redrawn every few seconds (``--watch``).
Works with any kubeconfig: the one given, else ``KUBECONFIG`` / ``~/.kube/config`` / the
in-cluster ServiceAccount (lightkube's discovery, as kubectl does). Reads only: pools, VMs and
Events (one namespace or all), the agents' Leases (any namespace, by label) and the
installation's operator and agent pods (any namespace, by label: why one is not ready, e.g. an
image that cannot be pulled)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

import yaml
from lightkube import AsyncClient, ConfigError
from lightkube import operators as op
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Pod
from rich.console import Console
from rich.live import Live

from impvm.api.models import AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.commands.statusview import Snapshot, render, summarize


def discover(kubeconfig: Path | None = None, context: str | None = None) -> SingleConfig:
    """The cluster configuration: ``kubeconfig`` (and ``context``) if given, else lightkube's
    discovery (in-cluster ServiceAccount, ``KUBECONFIG``, ``~/.kube/config``). Raises
    ``lightkube.ConfigError`` (one line) when none is found or the file cannot be read or
    parsed."""
    try:
        found = (
            KubeConfig.from_file(str(kubeconfig))
            if kubeconfig is not None
            else KubeConfig.from_env()
        ).get(context_name=context)
    except ConfigError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    except (OSError, ValueError, yaml.YAMLError) as e:  # missing, unreadable, not YAML
        raise ConfigError(" ".join(str(e).split()) or type(e).__name__) from None
    except (KeyError, TypeError, AttributeError) as e:  # YAML of another shape
        raise ConfigError(f"not a kubeconfig ({type(e).__name__}: {e})") from None
    if found is None:
        raise ConfigError("the kubeconfig names no current context")
    return found


def client(kubeconfig: Path | None = None, context: str | None = None) -> AsyncClient:
    """A read-only use of the cluster configured by :func:`discover` (raises as it does, also
    when a certificate or key file the kubeconfig names cannot be read)."""
    config = discover(kubeconfig, context)
    try:
        return AsyncClient(config=config)
    except OSError as e:  # e.g. certificate-authority: a file that is not there
        what = e.filename or "a certificate or key file it names"
        raise ConfigError(f"{what}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split()) or type(e).__name__) from None


async def read_snapshot(kube: AsyncClient, namespace: str | None = None) -> Snapshot:
    """Pools, VMs and Warning Events of ``namespace`` (None: every namespace) and every agent
    Lease. Raises ``ApiError`` (e.g. 403 when the identity may not list them)."""
    ns = namespace or "*"
    pools = [p.to_dict() async for p in kube.list(ImpVMRunnerPoolResource, namespace=ns)]
    vms = [v.to_dict() async for v in kube.list(ImpVMResource, namespace=ns)]
    events = [e.to_dict() async for e in kube.list(Event, namespace=ns, fields={"type": "Warning"})]
    label: Any = dict([AGENT_LEASE_LABEL])
    leases = [
        le.to_dict()
        async for le in kube.list(Lease, namespace="*", labels=label)
        if (le.metadata and (le.metadata.name or "").startswith(AGENT_LEASE_PREFIX))
    ]
    return Snapshot(dt.datetime.now(dt.UTC), pools, vms, leases, events, await _pods(kube))


async def _pods(kube: AsyncClient) -> list[dict[str, Any]]:
    """The installation's operator and agent pods in any namespace; none when the identity may
    not list pods (the rest of the status is still worth printing)."""
    labels: Any = {
        "app.kubernetes.io/name": "impvm",
        "app.kubernetes.io/component": op.in_(["operator", "agent"]),
    }
    try:
        return [p.to_dict() async for p in kube.list(Pod, namespace="*", labels=labels)]
    except ApiError as e:
        if e.status.code in (401, 403):
            return []
        raise


async def run(
    kube: AsyncClient,
    console: Console,
    *,
    namespace: str | None = None,
    output: str = "table",
    watch: bool = False,
    interval: float = 2.0,
    iterations: int | None = None,
) -> int:
    """Print the status; with ``watch`` redraw every ``interval`` seconds until interrupted
    (or ``iterations`` redraws, for tests). Returns the exit code: 0, or 1 when the API server
    refused (the message names what)."""

    async def once() -> dict[str, Any]:
        return summarize(await read_snapshot(kube, namespace))

    try:
        if not watch:
            doc = await once()
            if output == "json":
                console.print_json(json.dumps(doc))
            else:
                console.print(render(doc))
            return 0
        n = 0
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while iterations is None or n < iterations:
                doc = await once()
                if output == "json":
                    live.update(json.dumps(doc), refresh=True)
                else:
                    live.update(render(doc), refresh=True)
                n += 1
                if iterations is not None and n >= iterations:
                    break
                await asyncio.sleep(interval)
        return 0
    except ApiError as e:
        console.print(f"impvm status: the API server refused: {e.status.message}", style="red")
        return 1
