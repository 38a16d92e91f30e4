"""The pool pass's Kubernetes reads through API calls (:class:`KubeSource`: one list or get per
question, no cache), for tests that drive single passes and as the base of the operator's
cached reads (:class:`impvm.operator.sources.CachedSource`, same questions, same typed values).
Agent Leases are read in the agents' Lease namespace only."""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import (
    AGENT_LEASE_LABEL,
    AGENT_LEASE_NAMESPACE,
    AGENT_LEASE_PREFIX,
    POOL_LABEL,
)
from impvm.api.resources import ImpVMResource
from impvm.api.times import parse_time
from impvm.api.vm import VM
from impvm.scaling.nodes import NodeLease
from impvm.scaling.poolpass.world import PoolObj


class KubeSource:
    """Reads for the pool pass through one Kubernetes client (no cache).

    ``lease_namespace``: the namespace of the agents' Leases (the release namespace; the
    agents' ``--lease-namespace``). Leases are read there only: anyone with edit rights in a
    namespace can create a Lease with the agents' label, and one read from there would keep a
    dead node alive or announce capacity no node has."""

    def __init__(self, kube: AsyncClient, lease_namespace: str = AGENT_LEASE_NAMESPACE) -> None:
        self.kube = kube
        self.lease_namespace = lease_namespace

    async def start(self) -> None:
        """Nothing to start (the cached source starts its watches here)."""

    async def close(self) -> None:
        """Nothing to stop."""

    async def get(self, resource: Any, name: str, namespace: str | None) -> dict[str, Any] | None:
        """An object as a dict, or None when it does not exist (404)."""
        return await self.api_get(resource, name, namespace)

    async def api_get(
        self, resource: Any, name: str, namespace: str | None
    ) -> dict[str, Any] | None:
        """An object as the API server has it now, as a dict, or None (404)."""
        try:
            obj = await self.kube.get(resource, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        out: dict[str, Any] = obj.to_dict()
        return out

    async def vms(self, pool: PoolObj) -> tuple[VM, ...]:
        """The ImpVMs labelled for ``pool`` that it owns (never another pool's), by name."""
        labels: Any = {POOL_LABEL: pool.name}
        found = [
            VM.from_body(o.to_dict())
            async for o in self.kube.list(ImpVMResource, namespace=pool.namespace, labels=labels)
        ]
        return tuple(sorted((v for v in found if pool.uid in v.owner_uids), key=lambda v: v.name))

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
        """Every agent's Lease: those in :attr:`lease_namespace` with the agents' label and
        name prefix (never a Lease of another namespace)."""
        label: Any = dict([AGENT_LEASE_LABEL])
        out = []
        async for lease in self.kube.list(Lease, namespace=self.lease_namespace, labels=label):
            parsed = lease_of(lease.to_dict())
            if parsed is not None:
                out.append(parsed)
        return tuple(out)

    async def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        """The labels of ``namespace`` (its name is among them, ``kubernetes.io/metadata.name``),
        or None when it does not exist."""
        found = await self.api_get(Namespace, namespace, None)
        if found is None:
            return None
        return dict(((found.get("metadata") or {}).get("labels")) or {})

    def written(self, resource: Any, raw: dict[str, Any]) -> None:
        """An object a write of this process returned (kept by the cached source)."""

    def vm_deleted(self, namespace: str, name: str) -> None:
        """A VM this process deleted (marked deleting by the cached source)."""


def lease_of(raw: dict[str, Any]) -> NodeLease | None:
    """An agent Lease as a dict -> :class:`NodeLease`; None for a Lease of another name."""
    meta = raw.get("metadata") or {}
    if not (meta.get("name") or "").startswith(AGENT_LEASE_PREFIX):
        return None
    spec = raw.get("spec") or {}
    renewed = spec.get("renewTime")
    return NodeLease.parse(
        spec.get("holderIdentity") or "",
        parse_time(renewed),
        spec.get("leaseDurationSeconds") or 40,
        meta.get("annotations") or {},
    )


def parse_vm(raw: dict[str, Any]) -> VM:
    return VM.from_body(raw)
