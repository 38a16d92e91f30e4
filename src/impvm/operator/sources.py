"""Where the pool pass's observer gets its Kubernetes facts.

:class:`KubeSource` reads through API calls (one list or get per question); :class:`CachedSource`
answers the same questions, with the same typed values, from list+watch caches
(:mod:`impvm.watchcache`, client-go's informer pattern), so an idle operator sends no request per
pool pass. The operator process uses :class:`CachedSource`; tests that drive single passes may
use either.

What :class:`CachedSource` watches (one cache per kind and watched namespace, ``"*"`` when the
operator is cluster-wide), and the most objects each holds (:data:`MAX_OBJECTS`):

* ImpVMRunnerPools, ImpVMTemplates, ImpVMClasses: whole objects (as dicts);
* ImpVMs labelled ``imp.dev/runner-pool``: parsed once per change into
  :class:`~impvm.scaling.world.VMObj`, indexed by pool;
* Secrets labelled ``imp.dev/runner-pool`` (the VMs' JIT Secrets): their names only, indexed by
  pool (the JIT config itself is never held);
* every other Secret (credentials, webhook and verify-key Secrets): name, resourceVersion and
  the data values of at most :data:`SECRET_VALUE_MAX_BYTES` (larger values, e.g. Helm release
  payloads, are left out: no key the operator reads is that large);
* agent Leases (by label, any namespace), parsed into :class:`~impvm.scaling.nodes.NodeLease`.

Consistency (what makes a pass decided from caches as sound as one decided from lists):

* **own writes**: the executor hands every object a write returned to :meth:`CachedSource.written`
  (VM create and patches, JIT Secret create, pool status patch) and marks a VM it deleted
  (:meth:`CachedSource.vm_deleted`); the next pass never decides on the state before them;
* **ordering with GitHub's registrations** (:mod:`impvm.scaling.pool`: registrations are read
  before the VMs, so every registration seen has its VM): every VM this operator creates is in
  the VM cache the moment its create returns, before its JIT registration is requested, and the
  watch only adds newer state. A runner list whose request started before a read of the VM cache
  therefore never holds a registration whose VM the cache lacks. The runner directory
  (:mod:`impvm.operator.runners`) keeps the other half: no list older than the pool's last
  registration change is used;
* **first list**: a read waits for its cache's first complete list (up to
  :data:`SYNC_TIMEOUT_SECONDS`; after that the read goes to the API server, e.g. when RBAC
  refuses the list, and says so in the log).

Changes wake pools: a VM change its pool, a template or class edit the pools whose last pass used
it, a pool edit that pool (``on_vm``, ``on_template``, ``on_class``, ``on_pool``). Changes that
are this process's own writes wake nothing: the pass that wrote them asked for its next pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lightkube import AsyncClient
from lightkube import operators as op
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Secret

from impvm.api.models import AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX, POOL_LABEL
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.operator.metrics import VM_LIFETIME
from impvm.scaling.nodes import NodeLease
from impvm.scaling.world import PoolObj, VMObj, parse_time
from impvm.watchcache import Key, WatchCache, key_of

log = logging.getLogger("impvm.operator.sources")

#: The most objects one cache holds (per kind and watched namespace). At the fleet benchmark's
#: 2,000 VMs the VM cache holds ~3 KiB a VM.
MAX_OBJECTS = {
    "pools": 2_000,
    "templates": 2_000,
    "classes": 1_000,
    "vms": 20_000,
    "jit-secrets": 20_000,
    "secrets": 5_000,
    "leases": 5_000,
}
#: Secret data values larger than this (bytes of base64) are not cached.
SECRET_VALUE_MAX_BYTES = 16 * 1024
#: Seconds a read waits for its cache's first list before asking the API server itself.
SYNC_TIMEOUT_SECONDS = 30.0


class KubeSource:
    """Reads for the pool pass through one Kubernetes client (no cache)."""

    def __init__(self, kube: AsyncClient) -> None:
        self.kube = kube

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

    async def vms(self, pool: PoolObj) -> tuple[VMObj, ...]:
        """The ImpVMs labelled for ``pool`` that it owns (never another pool's), by name."""
        labels: Any = {POOL_LABEL: pool.name}
        found = [
            VMObj.from_body(o.to_dict())
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
        """Every agent's Lease, in any namespace (``impvm agent --lease-namespace``), found by
        its label and name prefix."""
        label: Any = dict([AGENT_LEASE_LABEL])
        out = []
        async for lease in self.kube.list(Lease, namespace="*", labels=label):
            parsed = _lease(lease.to_dict())
            if parsed is not None:
                out.append(parsed)
        return tuple(out)

    def written(self, resource: Any, raw: dict[str, Any]) -> None:
        """An object a write of this process returned (kept by the cached source)."""

    def vm_deleted(self, namespace: str, name: str) -> None:
        """A VM this process deleted (marked deleting by the cached source)."""


def _lease(raw: dict[str, Any]) -> NodeLease | None:
    """An agent Lease as a dict -> :class:`NodeLease`; None for a Lease of another name."""
    meta = raw.get("metadata") or {}
    if not (meta.get("name") or "").startswith(AGENT_LEASE_PREFIX):
        return None
    spec = raw.get("spec") or {}
    renewed = spec.get("renewTime")
    return NodeLease.parse(
        spec.get("holderIdentity") or "",
        parse_time(renewed) if isinstance(renewed, str) else renewed,
        spec.get("leaseDurationSeconds") or 40,
        meta.get("annotations") or {},
    )


@dataclass(frozen=True, slots=True)
class _VM:
    pool: str
    vm: VMObj


def _parse_vm(raw: dict[str, Any]) -> _VM:
    pool = ((raw.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL) or ""
    return _VM(str(pool), VMObj.from_body(raw))


def _parse_jit_secret(raw: dict[str, Any]) -> str:
    """A JIT Secret -> its pool's name (the config itself is not kept)."""
    return str(((raw.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL) or "")


def _parse_secret(raw: dict[str, Any]) -> dict[str, Any]:
    """A Secret -> name, namespace, resourceVersion and its small data values."""
    meta = raw.get("metadata") or {}
    data = {
        k: v
        for k, v in (raw.get("data") or {}).items()
        if isinstance(v, str) and len(v) <= SECRET_VALUE_MAX_BYTES
    }
    kept = {k: meta.get(k) for k in ("name", "namespace", "resourceVersion", "uid")}
    return {"metadata": kept, "data": data}


def _whole(raw: dict[str, Any]) -> dict[str, Any]:
    return raw


class _Index:
    """Names of cached objects by (namespace, pool), kept in step with one cache."""

    def __init__(self) -> None:
        self.by_pool: dict[tuple[str, str], set[str]] = {}
        self.pool_of: dict[Key, str] = {}

    def update(self, key: Key, pool: str | None) -> tuple[str | None, str | None]:
        """Record that ``key`` now belongs to ``pool`` (None: gone). Returns (old, new) pool."""
        old = self.pool_of.get(key)
        if old == pool:
            return old, pool
        if old is not None:
            names = self.by_pool.get((key[0], old))
            if names is not None:
                names.discard(key[1])
                if not names:
                    del self.by_pool[(key[0], old)]
            del self.pool_of[key]
        if pool is not None:
            self.pool_of[key] = pool
            self.by_pool.setdefault((key[0], pool), set()).add(key[1])
        return old, pool

    def names(self, namespace: str, pool: str) -> list[str]:
        return sorted(self.by_pool.get((namespace, pool), ()))


Wake = Callable[[str, str], None]


class CachedSource(KubeSource):
    """The pool pass's reads from watch caches (see the module docstring).

    ``namespaces``: the namespaces watched (empty: all, ``"*"``). Call :meth:`start` once (it
    starts the watches and returns), :meth:`close` at the end. ``on_vm(namespace, pool)``,
    ``on_template(namespace, name)``, ``on_class("", name)`` and ``on_pool(namespace, name)`` are
    called for changes the watches deliver (never for this process's own writes); they must not
    block."""

    def __init__(
        self,
        kube: AsyncClient,
        namespaces: list[str] | None = None,
        *,
        on_vm: Wake | None = None,
        on_template: Wake | None = None,
        on_class: Wake | None = None,
        on_pool: Wake | None = None,
        max_objects: dict[str, int] | None = None,
    ) -> None:
        super().__init__(kube)
        self.namespaces = list(namespaces or ["*"])
        limits = {**MAX_OBJECTS, **(max_objects or {})}
        self._vm_index = _Index()
        #: each cached VM's pool and creation time, to observe its lifetime when it goes
        self._vm_born: dict[Key, tuple[str, dt.datetime]] = {}
        self._secret_index = _Index()
        self.on_vm, self.on_template, self.on_class, self.on_pool = (
            on_vm,
            on_template,
            on_class,
            on_pool,
        )
        pool_label: Any = {POOL_LABEL: op.exists()}
        other: Any = {POOL_LABEL: op.not_exists()}
        self.caches: dict[str, list[WatchCache[Any]]] = {}

        def per_ns(kind: str, resource: Any, parse: Any, wake: Any, **kw: Any) -> None:
            self.caches[kind] = [
                WatchCache(
                    kube,
                    resource,
                    parse,
                    namespace=ns,
                    max_objects=limits[kind],
                    on_change=wake,
                    name=f"{kind} in {ns}",
                    **kw,
                )
                for ns in self.namespaces
            ]

        per_ns("pools", ImpVMRunnerPoolResource, _whole, self._pool_changed)
        per_ns("templates", ImpVMTemplateResource, _whole, self._template_changed)
        per_ns("vms", ImpVMResource, _parse_vm, self._vm_changed, labels=pool_label)
        per_ns("jit-secrets", Secret, _parse_jit_secret, self._jit_changed, labels=pool_label)
        per_ns("secrets", Secret, _parse_secret, None, labels=other)
        self.caches["classes"] = [
            WatchCache(
                kube,
                ImpVMClassResource,
                _whole,
                namespace=None,
                max_objects=limits["classes"],
                on_change=self._class_changed,
                name="classes",
            )
        ]
        label: Any = dict([AGENT_LEASE_LABEL])
        self.caches["leases"] = [
            WatchCache(
                kube,
                Lease,
                _lease,
                namespace="*",
                labels=label,
                max_objects=limits["leases"],
                name="agent leases",
            )
        ]
        self._by_resource: dict[Any, str] = {
            ImpVMRunnerPoolResource: "pools",
            ImpVMTemplateResource: "templates",
            ImpVMClassResource: "classes",
            Secret: "secrets",
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every watch (each lists first; reads wait for their first list)."""
        if self._tasks:
            return
        for caches in self.caches.values():
            for c in caches:
                self._tasks.append(asyncio.create_task(c.run(), name=f"watch {c.name}"))

    async def close(self) -> None:
        """Stop every watch."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    async def synced(self) -> None:
        """Wait until every cache has its first list."""
        for caches in self.caches.values():
            for c in caches:
                await c.synced.wait()

    def _cache(self, kind: str, namespace: str | None) -> WatchCache[Any] | None:
        caches = self.caches[kind]
        if kind == "classes" or kind == "leases":
            return caches[0]
        for c in caches:
            if c.namespace in ("*", namespace):
                return c
        return None

    async def _ready(self, cache: WatchCache[Any] | None) -> WatchCache[Any] | None:
        """``cache`` once it has its first list; None (read the API) if it has none in time or
        was never started."""
        if cache is None:
            return None
        if not cache.synced.is_set():
            if not self._tasks:
                return None  # not started
            try:
                await asyncio.wait_for(cache.synced.wait(), SYNC_TIMEOUT_SECONDS)
            except TimeoutError:
                log.warning("%s: no first list yet; reading the API server", cache.name)
                return None
        return cache

    async def get(self, resource: Any, name: str, namespace: str | None) -> dict[str, Any] | None:
        """An object as a dict from its cache (a Secret: only its small data values), or None
        when it does not exist; kinds without a cache are read from the API server."""
        kind = self._by_resource.get(resource)
        cache = await self._ready(self._cache(kind, namespace) if kind else None)
        if cache is None:
            return await self.api_get(resource, name, namespace)
        found: dict[str, Any] | None = cache.get((namespace or "", name))
        return found

    async def vms(self, pool: PoolObj) -> tuple[VMObj, ...]:
        cache = await self._ready(self._cache("vms", pool.namespace))
        if cache is None:
            return await super().vms(pool)
        out = []
        for name in self._vm_index.names(pool.namespace, pool.name):
            found = cache.get((pool.namespace, name))
            if found is not None and pool.uid in found.vm.owner_uids:
                out.append(found.vm)
        return tuple(out)

    async def secret_names(self, pool: PoolObj) -> frozenset[str]:
        cache = await self._ready(self._cache("jit-secrets", pool.namespace))
        if cache is None:
            return await super().secret_names(pool)
        return frozenset(self._secret_index.names(pool.namespace, pool.name))

    async def leases(self) -> tuple[NodeLease, ...]:
        cache = await self._ready(self._cache("leases", None))
        if cache is None:
            return await super().leases()
        return tuple(v for v in cache.values() if v is not None)

    # ---------------------------------------------------------------- own writes

    def written(self, resource: Any, raw: dict[str, Any]) -> None:
        """Put an object a write of this process returned into its cache now."""
        ns = (raw.get("metadata") or {}).get("namespace")
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if resource is ImpVMResource or resource is ImpVMResource.Status:
            cache, index = self._cache("vms", ns), self._vm_index
        elif resource is Secret and POOL_LABEL in labels:
            cache, index = self._cache("jit-secrets", ns), self._secret_index
        elif resource is ImpVMRunnerPoolResource or resource is ImpVMRunnerPoolResource.Status:
            cache, index = self._cache("pools", ns), None
        else:
            return
        if cache is None:
            return
        cache.written(raw)
        if index is not None:
            key = key_of(raw)
            found = cache.get(key)
            index.update(key, None if found is None else _pool_of(found))

    def vm_deleted(self, namespace: str, name: str) -> None:
        """Mark a VM this process deleted as deleting (until the watch reports it)."""
        cache = self._cache("vms", namespace)
        if cache is not None:
            cache.mark((namespace, name), lambda v: replace(v, vm=replace(v.vm, deleting=True)))

    # ---------------------------------------------------------------- wake-ups

    def _vm_changed(self, key: Key) -> None:
        cache = self._cache("vms", key[0])
        found = cache.get(key) if cache is not None else None
        old, new = self._vm_index.update(key, None if found is None else found.pool)
        if found is not None:
            self._vm_born[key] = (found.pool, found.vm.created_at)
        elif (
            (born := self._vm_born.pop(key, None)) is not None
            and born[0]
            and born[1].timestamp() > 0
        ):
            # a VM's life ends when the API server removes it (after its finalizers), whoever
            # deleted it: the pool pass, the reaper, a person, the garbage collector
            lived = (dt.datetime.now(dt.UTC) - born[1]).total_seconds()
            VM_LIFETIME.labels(key[0], born[0]).observe(max(0.0, lived))
        if self.on_vm is not None:
            for pool in {old, new} - {None, ""}:
                self.on_vm(key[0], str(pool))

    def _jit_changed(self, key: Key) -> None:
        cache = self._cache("jit-secrets", key[0])
        found = cache.get(key) if cache is not None else None
        self._secret_index.update(key, found)

    def _template_changed(self, key: Key) -> None:
        if self.on_template is not None:
            self.on_template(*key)

    def _class_changed(self, key: Key) -> None:
        if self.on_class is not None:
            self.on_class(*key)

    def _pool_changed(self, key: Key) -> None:
        if self.on_pool is not None:
            self.on_pool(*key)


def _pool_of(value: Any) -> str | None:
    """The pool a cached VM (:class:`_VM`) or JIT Secret (its pool's name) belongs to."""
    if isinstance(value, _VM):
        return value.pool
    return str(value) if value else None
