"""Where the pool pass's observer gets its Kubernetes facts.

:class:`KubeSource` reads through API calls (one list or get per question); :class:`CachedSource`
answers the same questions, with the same typed values, from list+watch caches
(:mod:`impvm.kube.watchcache`, client-go's informer pattern), so an idle operator sends no
request per pool pass. The operator process uses :class:`CachedSource`; tests that drive single
passes may use either.

What :class:`CachedSource` watches (one cache per kind and watched namespace, ``"*"`` when the
operator is cluster-wide), and the most objects each holds (:data:`MAX_OBJECTS`):

* ImpVMRunnerPools, ImpVMTemplates, ImpVMClasses: whole objects (as dicts);
* ImpVMs labelled ``imp.dev/runner-pool``: parsed once per change into
  :class:`~impvm.api.vm.VM` (the one VM read model), indexed by pool;
* Secrets labelled ``imp.dev/runner-pool`` (the VMs' JIT Secrets): their names only, indexed by
  pool (the JIT config itself is never held);
* **only the Secrets a pool or template names** (credentials, webhook and verify-key Secrets,
  :func:`named_secrets`): each watched by name (a field selector ``metadata.name``, like the
  kubelet's watch-based Secret manager), so no other Secret is ever listed, read or held; of
  each, name, resourceVersion and the data values of at most :data:`SECRET_VALUE_MAX_BYTES`;
* agent Leases (by label, in the agents' Lease namespace only: a Lease elsewhere is a tenant's,
  never a node's), parsed into :class:`~impvm.scaling.nodes.NodeLease`.

VMs and JIT Secrets carry a label anyone with edit rights in a namespace can set, so those caches
hold at most :data:`MAX_PER_NAMESPACE` objects of one namespace: a namespace that makes more
fills its own share, never another's.

Consistency (what makes a pass decided from caches as sound as one decided from lists):

* **own writes**: the executor hands every object a write returned to :meth:`CachedSource.written`
  (VM create and patches, JIT Secret create, pool status patch) and marks a VM it deleted
  (:meth:`CachedSource.vm_deleted`); the next pass never decides on the state before them;
* **ordering with GitHub's registrations** (:mod:`impvm.scaling.poolpass.sizing`:
  registrations are read before the VMs, so every registration seen has its VM): every VM this
  operator creates is in the VM cache the moment its create returns, before its JIT
  registration is requested, and the watch only adds newer state. A runner list whose request
  started before a read of the VM cache therefore never holds a registration whose VM the cache
  lacks. The runner directory (:mod:`impvm.operator.runners`) keeps the other half: no list
  older than the pool's last registration change is used;
* **first list**: a read waits for its cache's first complete list (up to
  :data:`SYNC_TIMEOUT_SECONDS`; after that the read goes to the API server, e.g. when RBAC
  refuses the list, and says so in the log).

Changes wake pools: a VM change its pool, a template or class edit the pools whose last pass used
it, a pool edit that pool (``on_vm``, ``on_template``, ``on_class``, ``on_pool``); a Lease
change wakes the placement (``on_lease``, :mod:`impvm.operator.scheduler`). Changes that are this
process's own writes wake nothing: the pass that wrote them asked for its next pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightkube import AsyncClient
from lightkube import operators as op
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Secret

from impvm.api.models import (
    AGENT_LEASE_LABEL,
    AGENT_LEASE_NAMESPACE,
    POOL_LABEL,
)
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.api.vm import VM
from impvm.kube.store import GroupIndex
from impvm.kube.watchcache import Key, WatchCache, key_of
from impvm.operator.kubesource import KubeSource, lease_of, parse_vm
from impvm.operator.metrics import VM_LIFETIME
from impvm.operator.named import SYNC_TIMEOUT_SECONDS, named_namespaces, named_secrets
from impvm.scaling.nodes import NodeLease
from impvm.scaling.poolpass.world import PoolObj

log = logging.getLogger("impvm.operator.sources")

#: The most objects one cache holds (per kind and watched namespace). At the fleet benchmark's
#: 2,000 VMs the VM cache holds ~3 KiB a VM.
MAX_OBJECTS = {
    "pools": 2_000,
    "templates": 2_000,
    "classes": 1_000,
    "vms": 20_000,
    "jit-secrets": 20_000,
    "leases": 5_000,
}
#: The most VMs and JIT Secrets of one namespace a cache holds.
MAX_PER_NAMESPACE = {"vms": 5_000, "jit-secrets": 5_000}


def _parse_jit_secret(raw: dict[str, Any]) -> str:
    """A JIT Secret -> its pool's name (the config itself is not kept)."""
    return str(((raw.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL) or "")


def _whole(raw: dict[str, Any]) -> dict[str, Any]:
    return raw


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
        on_lease: Wake | None = None,
        max_objects: dict[str, int] | None = None,
        lease_namespace: str = AGENT_LEASE_NAMESPACE,
    ) -> None:
        super().__init__(kube, lease_namespace)
        self.namespaces = list(namespaces or ["*"])
        limits = {**MAX_OBJECTS, **(max_objects or {})}
        self._vm_index = GroupIndex()
        #: each cached VM's pool and creation time, to observe its lifetime when it goes
        self._vm_born: dict[Key, tuple[str, dt.datetime]] = {}
        self._secret_index = GroupIndex()
        self.on_vm, self.on_template, self.on_class, self.on_pool = (
            on_vm,
            on_template,
            on_class,
            on_pool,
        )
        self.on_lease = on_lease
        pool_label: Any = {POOL_LABEL: op.exists()}
        self.caches: dict[str, list[WatchCache[Any]]] = {}

        def per_ns(kind: str, resource: Any, parse: Any, wake: Any, **kw: Any) -> None:
            self.caches[kind] = [
                WatchCache(
                    kube,
                    resource,
                    parse,
                    namespace=ns,
                    max_objects=limits[kind],
                    max_per_namespace=MAX_PER_NAMESPACE.get(kind),
                    on_change=wake,
                    name=f"{kind} in {ns}",
                    **kw,
                )
                for ns in self.namespaces
            ]

        per_ns("pools", ImpVMRunnerPoolResource, _whole, self._pool_changed)
        per_ns("templates", ImpVMTemplateResource, _whole, self._template_changed)
        per_ns("vms", ImpVMResource, parse_vm, self._vm_changed, labels=pool_label)
        per_ns("jit-secrets", Secret, _parse_jit_secret, self._jit_changed, labels=pool_label)
        #: the Secrets pools and templates name, and the Namespaces classes select: each
        #: watched by name
        self.named = named_secrets(kube, self.namespaces)
        self.named_namespaces = named_namespaces(kube, self.namespaces)
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
                lease_of,
                namespace=lease_namespace,
                labels=label,
                max_objects=limits["leases"],
                on_change=self._lease_changed,
                name="agent leases",
            )
        ]
        self._by_resource: dict[Any, str] = {
            ImpVMRunnerPoolResource: "pools",
            ImpVMTemplateResource: "templates",
            ImpVMClassResource: "classes",
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
        await self.named.close()
        await self.named_namespaces.close()

    async def synced(self) -> None:
        """Wait until every cache has its first list (named Secrets are watched from their
        first read)."""
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
        """An object as a dict from its cache (a Secret: only its small data values, from its
        watch by name), or None when it does not exist; kinds without a cache are read from
        the API server."""
        if resource is Secret and namespace and self._tasks:
            return await self.named.get(namespace, name)
        kind = self._by_resource.get(resource)
        cache = await self._ready(self._cache(kind, namespace) if kind else None)
        if cache is None:
            return await self.api_get(resource, name, namespace)
        found: dict[str, Any] | None = cache.get((namespace or "", name))
        return found

    async def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        if not self._tasks:
            return await super().namespace_labels(namespace)
        found = await self.named_namespaces.get("", namespace)
        return None if found is None else dict(found["metadata"]["labels"])

    async def vms(self, pool: PoolObj) -> tuple[VM, ...]:
        cache = await self._ready(self._cache("vms", pool.namespace))
        if cache is None:
            return await super().vms(pool)
        out = []
        for name in self._vm_index.names(pool.namespace, pool.name):
            found = cache.get((pool.namespace, name))
            if found is not None and pool.uid in found.owner_uids:
                out.append(found)
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
            cache.mark((namespace, name), lambda v: replace(v, deleting=True))

    # ---------------------------------------------------------------- wake-ups

    def _vm_changed(self, key: Key) -> None:
        cache = self._cache("vms", key[0])
        found = cache.get(key) if cache is not None else None
        old, new = self._vm_index.update(key, None if found is None else found.pool)
        if found is not None:
            self._vm_born[key] = (found.pool, found.created_at)
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

    def _lease_changed(self, key: Key) -> None:
        if self.on_lease is not None:
            self.on_lease(*key)

    def class_spec(self, name: str) -> dict[str, Any] | None:
        """The cached ImpVMClass ``name``'s spec (wire form; None: not cached)."""
        raw = self.caches["classes"][0].get(("", name))  # cluster-scoped: namespace ""
        spec = raw.get("spec") if raw is not None else None
        return spec if isinstance(spec, dict) else None

    def class_sizes(self) -> dict[str, tuple[int, int]]:
        """Every cached ImpVMClass's size: name -> (vCPU, MiB) (empty before the first list;
        a class without a valid size is left out)."""
        out: dict[str, tuple[int, int]] = {}
        for raw in self.caches["classes"][0].values():
            spec = raw.get("spec") or {}
            vcpu, mib = spec.get("vcpu"), spec.get("memoryMiB")
            if isinstance(vcpu, int) and isinstance(mib, int):
                out[str(raw["metadata"]["name"])] = (vcpu, mib)
        return out


def _pool_of(value: Any) -> str | None:
    """The pool a cached VM or JIT Secret (its pool's name) belongs to."""
    if isinstance(value, VM):
        return value.pool
    return str(value) if value else None
