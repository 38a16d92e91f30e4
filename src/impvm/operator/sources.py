"""Where the pool pass's observer gets its Kubernetes facts. Today each read is an API call;
a watch cache (a kopf index or an informer) can stand in for any method without changing the
observer or the decision, as long as it returns the same typed values."""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Secret

from impvm.api.models import AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX, POOL_LABEL
from impvm.api.resources import ImpVMResource
from impvm.scaling.nodes import NodeLease
from impvm.scaling.world import PoolObj, VMObj


class KubeSource:
    """Reads for the pool pass through one Kubernetes client."""

    def __init__(self, kube: AsyncClient) -> None:
        self.kube = kube

    async def get(self, resource: Any, name: str, namespace: str | None) -> dict[str, Any] | None:
        """An object as a dict, or None when it does not exist (404)."""
        try:
            obj = await self.kube.get(resource, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        out: dict[str, Any] = obj.to_dict()
        return out

    async def vms(self, pool: PoolObj) -> tuple[VMObj, ...]:
        """The ImpVMs labelled for ``pool`` that it owns (never another pool's)."""
        labels: Any = {POOL_LABEL: pool.name}
        found = [
            VMObj.from_body(o.to_dict())
            async for o in self.kube.list(ImpVMResource, namespace=pool.namespace, labels=labels)
        ]
        return tuple(v for v in found if pool.uid in v.owner_uids)

    async def secret_names(self, pool: PoolObj) -> frozenset[str]:
        """Names of the Secrets labelled for ``pool`` (its VMs' JIT Secrets)."""
        labels: Any = {POOL_LABEL: pool.name}
        return frozenset(
            [
                s.metadata.name
                async for s in self.kube.list(Secret, namespace=pool.namespace, labels=labels)
                if s.metadata and s.metadata.name
            ]
        )

    async def leases(self) -> tuple[NodeLease, ...]:
        """Every agent's Lease, in any namespace (``impvm agent --lease-namespace``), found by
        its label and name prefix."""
        label: Any = dict([AGENT_LEASE_LABEL])
        out = []
        async for lease in self.kube.list(Lease, namespace="*", labels=label):
            if not (lease.metadata and (lease.metadata.name or "").startswith(AGENT_LEASE_PREFIX)):
                continue
            spec = lease.spec
            out.append(
                NodeLease.parse(
                    (spec.holderIdentity if spec else None) or "",
                    spec.renewTime if spec else None,
                    (spec.leaseDurationSeconds if spec else None) or 40,
                    (lease.metadata.annotations if lease.metadata else None) or {},
                )
            )
        return tuple(out)
