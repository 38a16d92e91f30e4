"""``impvm logs VM``: print a VM's console. For a failed VM that is the copy its agent kept
(bounded, JIT config scrubbed), found from ``status.consoleLog`` or, once the VM is deleted,
from its ``ConsoleLogKept`` Event; for a running VM its live console in the agent's workdir
(advertised on the agent's Lease). The file is read on this machine: ``impvm up`` runs the agent
here; on a cluster run the command on that node (or in its agent pod) — the error says which
node and path. What is printed is the guest's text without terminal control sequences."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event

from impvm.agent.guesttext import printable
from impvm.api.models import AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX
from impvm.api.resources import ImpVMResource

#: Lease annotation with the agent's workdir (live consoles are under ``vms/<vm id>/``)
WORKDIR_ANNOTATION = "imp.dev/workdir"
_KEPT = re.compile(r"console log kept on node (\S+) at (\S+);")


class LogsError(Exception):
    """Why the log cannot be printed (one line for the user)."""


@dataclass(frozen=True)
class ConsoleLocation:
    """Where a VM's console is: ``node`` and ``path`` on it; ``kept``: the copy of a failed
    VM (else the live console)."""

    node: str
    path: str
    kept: bool


async def locate(kube: AsyncClient, namespace: str, name: str) -> ConsoleLocation:
    """Find VM ``namespace/name``'s console. Raises :class:`LogsError` when there is none."""
    try:
        raw = (await kube.get(ImpVMResource, name, namespace=namespace)).to_dict()
    except ApiError as e:
        if e.status.code != 404:
            raise LogsError(f"cannot read ImpVM {namespace}/{name}: {e.status.message}") from None
        return await _from_events(kube, namespace, name)
    status = raw.get("status") or {}
    where = status.get("consoleLog")
    if where:
        node, _, path = str(where).partition(":")
        return ConsoleLocation(node, path, kept=True)
    node = str((raw.get("spec") or {}).get("nodeName") or "")
    if not node:
        raise LogsError(f"ImpVM {namespace}/{name} is on no node yet: it has no console")
    workdir = await _agent_workdir(kube, node)
    if workdir is None:
        raise LogsError(f"the agent of node {node} does not advertise its workdir")
    vm_id = f"{namespace}.{name}.{raw['metadata']['uid'][:8]}"
    return ConsoleLocation(node, f"{workdir}/vms/{vm_id}/console.log", kept=False)


async def _from_events(kube: AsyncClient, namespace: str, name: str) -> ConsoleLocation:
    found: list[tuple[str, ConsoleLocation]] = []
    async for ev in kube.list(
        Event, namespace=namespace, fields={"involvedObject.name": name, "reason": "ConsoleLogKept"}
    ):
        m = _KEPT.search(ev.message or "")
        if m:
            when = str(ev.lastTimestamp or ev.eventTime or "")
            found.append((when, ConsoleLocation(m.group(1), m.group(2), kept=True)))
    if not found:
        raise LogsError(f"ImpVM {namespace}/{name} not found, and no console of it was kept")
    return max(found, key=lambda f: f[0])[1]


async def _agent_workdir(kube: AsyncClient, node: str) -> str | None:
    label = dict([AGENT_LEASE_LABEL])
    async for le in kube.list(Lease, namespace="*", labels=label):  # type: ignore[arg-type]
        meta = le.metadata
        if meta is None or meta.name != AGENT_LEASE_PREFIX + node:
            continue
        return (meta.annotations or {}).get(WORKDIR_ANNOTATION)
    return None


def read(loc: ConsoleLocation) -> bytes:
    """The console as UTF-8 text safe to print (:func:`impvm.agent.guesttext.printable`: a guest's
    bytes never reach the terminal's control functions), read on this machine. Raises
    :class:`LogsError` naming the node and path when it is not here (another node, or
    removed)."""
    try:
        return printable(Path(loc.path).read_bytes()).encode()
    except FileNotFoundError:
        what = "kept console" if loc.kept else "live console"
        raise LogsError(
            f"the {what} is on node {loc.node} at {loc.path}, not on this machine: run "
            "impvm logs on that node (or in its agent pod)"
        ) from None
    except PermissionError:
        raise LogsError(f"{loc.path}: permission denied (the agent's files are root's)") from None
