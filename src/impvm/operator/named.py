"""Objects the operator reads by name, each watched on its own (:class:`NamedWatches`): the
Secrets pools and templates name (credentials, webhook and verify-key Secrets,
:func:`named_secrets`) and the Namespaces whose labels a class's ``spec.namespaces`` selects
(:func:`named_namespaces`). No other Secret is ever listed, read or held, like the kubelet's
watch-based Secret manager; of each Secret only its name, resourceVersion and data values of at
most :data:`SECRET_VALUE_MAX_BYTES` are kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.kube.watchcache import Key, WatchCache

log = logging.getLogger("impvm.operator.sources")

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
