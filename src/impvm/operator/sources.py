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
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lightkube import AsyncClient
from lightkube import operators as op
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import (
    AGENT_LEASE_LABEL,
    AGENT_LEASE_NAMESPACE,
    AGENT_LEASE_PREFIX,
    POOL_LABEL,
)
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.api.times import parse_time
from impvm.api.vm import VM
from impvm.kube.watchcache import Key, WatchCache, key_of
from impvm.operator.metrics import VM_LIFETIME
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
#: Secrets watched by name: in one namespace, and in all. A Secret beyond either is read from
#: the API server instead (at most every :data:`NAMED_SECRET_TTL_SECONDS`), so a tenant naming
#: many Secrets slows only its own passes.
NAMED_SECRETS_PER_NAMESPACE = 32
NAMED_SECRETS = 2_000
#: Watches one Kubernetes client carries (each is a connection; the HTTP client keeps at most
#: 100), so the named watches never take the connections of the operator's other requests.
WATCHES_PER_CLIENT = 80
NAMED_SECRET_TTL_SECONDS = 10.0
#: Seconds after its last read a named Secret's watch is stopped (no pool names it any more).
NAMED_SECRET_FORGET_SECONDS = 900.0
#: Secret data values larger than this (bytes of base64) are not cached.
SECRET_VALUE_MAX_BYTES = 16 * 1024
#: Seconds a read waits for its cache's first list before asking the API server itself.
SYNC_TIMEOUT_SECONDS = 30.0


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
            parsed = _lease(lease.to_dict())
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


def _lease(raw: dict[str, Any]) -> NodeLease | None:
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


def _parse_vm(raw: dict[str, Any]) -> VM:
    return VM.from_body(raw)


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


@dataclass
class _Named:
    """One Secret read by name: its watch (None: read with a short cache instead), when it was
    last asked for, and the last read of an unwatched one."""

    used: float
    cache: WatchCache[dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = None
    client: AsyncClient | None = None
    value: dict[str, Any] | None = None
    read_at: float | None = None


class NamedWatches:
    """Objects read by name, each watched on its own: the Secrets pools and templates name
    (:func:`named_secrets`), and the Namespaces whose labels a class's ``spec.namespaces``
    selects (:func:`named_namespaces`); no other object of the kind is ever listed or held.

    Each object asked for by ``(namespace, name)`` (``("", name)`` for a cluster-scoped kind)
    gets a watch of its own (list + watch with the field selector ``metadata.name=<name>``, at
    most one object), started on its first read and stopped ``forget`` seconds after its last.
    The watches run on Kubernetes clients of their own, :data:`WATCHES_PER_CLIENT` each (one
    connection per watch), so they never take the connections the operator's other requests
    need. At most ``per_namespace`` objects of one namespace, and ``total`` in all, are
    watched; one beyond that is read from the API server, at most every ``ttl`` seconds (the
    namespace that names so many pays with its own requests; nobody else's is displaced).
    ``namespaces``: those the operator serves (``["*"]``: all); an object elsewhere is never
    read. ``clock``: monotonic seconds."""

    def __init__(
        self,
        kube: AsyncClient,
        resource: Any,
        parse: Callable[[dict[str, Any]], dict[str, Any]],
        namespaces: list[str] | None = None,
        *,
        cluster_scoped: bool = False,
        per_namespace: int = NAMED_SECRETS_PER_NAMESPACE,
        total: int = NAMED_SECRETS,
        ttl: float = NAMED_SECRET_TTL_SECONDS,
        forget: float = NAMED_SECRET_FORGET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.resource = resource
        self.parse = parse
        self.cluster_scoped = cluster_scoped
        self.namespaces = list(namespaces or ["*"])
        self.per_namespace = per_namespace
        self.total = total
        self.ttl = ttl
        self.forget = forget
        self.clock = clock
        self._entries: dict[Key, _Named] = {}
        self._clients: dict[AsyncClient, int] = {}
        self._swept = clock()
        #: reads answered by the API server (no watch for the object)
        self.api_reads = 0

    def _watched(self, namespace: str) -> int:
        return sum(1 for k, e in self._entries.items() if k[0] == namespace and e.cache)

    def held(self) -> list[Key]:
        """The Secrets held in memory (watched or recently read), by key."""
        out = []
        for key, e in self._entries.items():
            if (e.cache is not None and e.cache.get(key) is not None) or e.value is not None:
                out.append(key)
        return sorted(out)

    def _client(self) -> AsyncClient:
        for client, n in self._clients.items():
            if n < WATCHES_PER_CLIENT:
                self._clients[client] += 1
                return client
        client = AsyncClient(config=self.kube.config)
        self._clients[client] = 1
        return client

    def _watch(self, key: Key, entry: _Named) -> None:
        ns, name = key
        client = self._client()
        entry.client = client
        what = f"{getattr(self.resource, '__name__', 'object')} {ns}/{name}".replace(" /", " ")
        entry.cache = WatchCache(
            client,
            self.resource,
            self.parse,
            namespace=None if self.cluster_scoped else ns,
            fields={"metadata.name": name},
            max_objects=1,
            name=what,
        )
        entry.task = asyncio.get_running_loop().create_task(entry.cache.run(), name=f"watch {what}")

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as ``parse`` keeps it, or None when it does not exist (``namespace``
        ``""`` for a cluster-scoped kind). Raises lightkube's ``ApiError`` (e.g. 403) when the
        API server refuses an uncached read."""
        served = name if self.cluster_scoped else namespace
        if self.namespaces != ["*"] and served not in self.namespaces:
            return None  # not a namespace this operator serves
        key = (namespace, name)
        now = self.clock()
        self._sweep(now)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Named(used=now)
            if (
                self._watched(namespace) < self.per_namespace
                and sum(1 for e in self._entries.values() if e.cache) < self.total
            ):
                self._watch(key, entry)
            else:
                log.info("%s/%s: read without a watch (watch limit reached)", *key)
        entry.used = now
        cache = entry.cache
        if cache is not None:
            if not cache.synced.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cache.synced.wait(), SYNC_TIMEOUT_SECONDS)
            if cache.synced.is_set():
                return cache.get(key)
        if entry.read_at is not None and now - entry.read_at < self.ttl:
            return entry.value
        self.api_reads += 1
        try:
            got = await self.kube.get(
                self.resource, name, namespace=None if self.cluster_scoped else namespace
            )
            entry.value = self.parse(got.to_dict())
        except ApiError as e:
            if e.status.code != 404:
                raise
            entry.value = None
        entry.read_at = now
        return entry.value

    def _sweep(self, now: float) -> None:
        """Stop the watches of Secrets nobody asked for in ``forget`` seconds (once a minute)."""
        if now - self._swept < 60.0:
            return
        self._swept = now
        for key, entry in list(self._entries.items()):
            if now - entry.used >= self.forget:
                self._stop(entry)
                del self._entries[key]

    def _stop(self, entry: _Named) -> None:
        if entry.task is not None:
            entry.task.cancel()
        if entry.client is not None:
            self._clients[entry.client] -= 1

    async def close(self) -> None:
        """Stop every watch and close the clients."""
        tasks = [e.task for e in self._entries.values() if e.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._entries.clear()
        for client in list(self._clients):
            await client.close()
        self._clients.clear()


def named_secrets(kube: AsyncClient, namespaces: list[str] | None = None) -> NamedWatches:
    """The Secrets pools and templates name: credentials, webhook and verify-key Secrets."""
    return NamedWatches(kube, Secret, _parse_secret, namespaces)


def _parse_namespace(raw: dict[str, Any]) -> dict[str, Any]:
    """A Namespace -> its name and labels."""
    meta = raw.get("metadata") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})}}


def named_namespaces(kube: AsyncClient, namespaces: list[str] | None = None) -> NamedWatches:
    """The Namespaces whose labels a class's ``spec.namespaces`` is checked against."""
    return NamedWatches(
        kube,
        Namespace,
        _parse_namespace,
        namespaces,
        cluster_scoped=True,
        per_namespace=NAMED_SECRETS,
    )


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
        on_lease: Wake | None = None,
        max_objects: dict[str, int] | None = None,
        lease_namespace: str = AGENT_LEASE_NAMESPACE,
    ) -> None:
        super().__init__(kube, lease_namespace)
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
        per_ns("vms", ImpVMResource, _parse_vm, self._vm_changed, labels=pool_label)
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
                _lease,
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
