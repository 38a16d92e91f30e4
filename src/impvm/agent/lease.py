"""The agent's Lease ``impvm-agent-<node>`` (``coordination.k8s.io``): this node's liveness and
what it offers, read by the operator's placement (:mod:`impvm.operator.scheduler`) and its lost
node check (:mod:`impvm.scaling.nodes`). The annotations carry the node's capacity and what its
VMs use (vCPU, MiB), its runtime and accelerator, its work directory and the host preflight's
verdict; the agent applies the whole Lease at start and every ``lease_renew_seconds``."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from lightkube import AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from impvm.agent.capacity import Resources
from impvm.agent.doctor import lease_value
from impvm.agent.lifecycle import Preflight
from impvm.api.models import AGENT_LEASE_PREFIX

log = logging.getLogger("impvm.agent")


def agent_lease(
    node: str,
    namespace: str,
    duration_seconds: int,
    *,
    capacity: Resources,
    used: Resources,
    runtime: str,
    accelerator: str,
    workdir: Path,
    preflight: Preflight,
) -> Lease:
    """The Lease of ``node``, renewed now, with its capacity, runtime and accelerator."""
    annotations = {
        "imp.dev/vcpu": str(capacity.vcpu),
        "imp.dev/memory-mib": str(capacity.memory_mib),
        "imp.dev/vcpu-used": str(used.vcpu),
        "imp.dev/memory-mib-used": str(used.memory_mib),
        "imp.dev/runtime": runtime,
        "imp.dev/accelerator": accelerator,
        "imp.dev/workdir": str(workdir),
        "imp.dev/preflight": lease_value(preflight),
    }
    return Lease(
        metadata=ObjectMeta(
            name=AGENT_LEASE_PREFIX + node,
            namespace=namespace,
            annotations=annotations,
            labels={"app.kubernetes.io/name": "impvm-agent"},
        ),
        spec=LeaseSpec(
            holderIdentity=node,
            leaseDurationSeconds=duration_seconds,
            renewTime=dt.datetime.now(dt.UTC),
        ),
    )


async def apply_lease(client: AsyncClient, lease: Lease) -> None:
    """Apply ``lease`` whole (server-side apply as ``impvm-agent``). Raises ``ApiError``."""
    await client.apply(lease, field_manager="impvm-agent", force=True)


async def keep_renewing(renew: Callable[[], Awaitable[None]], every_seconds: float) -> None:
    """Renew the Lease every ``every_seconds``; a failure is retried next time."""
    while True:
        await asyncio.sleep(every_seconds)
        try:
            await renew()
        except Exception as e:  # keep renewing; the next try may work
            log.warning("lease renewal failed: %s", e)
