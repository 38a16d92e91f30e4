"""A local cache of one kind of Kubernetes object under a label/field selector, kept current by
list + watch: client-go's reflector and store (``k8s.io/client-go/tools/cache``), for lightkube.

How it stays correct (Kubernetes API concepts, "Efficient detection of changes"):

* **list, then watch from the list's resourceVersion**: every change after the list arrives, in
  order; a watch the server ends (``timeoutSeconds``) or that fails resumes from the last
  resourceVersion seen, so nothing is missed;
* **410 Gone** (the version was compacted away): list again; objects deleted meanwhile leave the
  cache without a DELETED event (the new list is compared with the old cache);
* **bounded**: the cache holds at most ``max_objects`` objects, and at most
  ``max_per_namespace`` of one namespace (so objects anyone may create in their own namespace
  never push another namespace's out); more are counted in ``Store.dropped``, logged, and
  picked up by a new list once a deletion makes room; no history: a deleted object is
  forgotten at once;
* **typed**: each object is parsed once, when it changes, by the ``parse`` function given (an
  object it rejects is logged by name and left out);
* **your own writes**: :meth:`WatchCache.written` puts the object a write returned into the cache
  at once, and the watch's older events for that object are ignored until the watch delivers
  that version (per-object events arrive in order), so a reconcile right after a write never
  decides on the state before it. A deletion answers with no object: :meth:`Store.mark` changes
  the stored one (e.g. marks it deleting) until the watch delivers a newer version; a write
  answered after the watch delivered its object's deletion is ignored (the uids of the last
  :data:`GONE_UIDS` deleted objects are kept). A write whose answer comes after the watch
  already delivered its version (and perhaps later ones) changes nothing: the cache is at least
  that new. The versions the watch delivered are remembered per object (the last
  :data:`SEEN_VERSIONS`) and compared only for equality: resourceVersions are opaque
  (Kubernetes API concepts).

:class:`Store` is the in-memory part (no I/O, unit-tested on its own); :class:`WatchCache` runs
the list and watch against the API server and calls ``on_change(key)`` for every object that was
added, changed or removed (never with a lock held; it must not block).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import on_error_raise

from impvm.kube.store import Key, Store, T, key_of, version_of

__all__ = ["Key", "Store", "WatchCache", "key_of"]

log = logging.getLogger("impvm.kube.watchcache")


class WatchCache(Generic[T]):
    """List + watch of ``resource`` (a lightkube resource class) in ``namespace`` (``"*"``: all
    namespaces; None for a cluster-scoped kind) under ``labels``/``fields`` selectors (lightkube
    selector dicts), kept in a :class:`Store`. ``on_change(key)`` is called for every object
    added, changed or removed. ``watch_timeout_seconds``: how long the server keeps one watch
    request open; ``retry_seconds``: first back-off after a failure (doubling up to
    ``max_retry_seconds``).

    Run :meth:`run` as a task; :attr:`synced` is set once the first list is in.
    """

    def __init__(
        self,
        client: AsyncClient,
        resource: Any,
        parse: Callable[[dict[str, Any]], T],
        *,
        namespace: str | None = "*",
        labels: dict[str, Any] | None = None,
        fields: dict[str, Any] | None = None,
        max_objects: int = 10_000,
        max_per_namespace: int | None = None,
        on_change: Callable[[Key], None] | None = None,
        name: str = "",
        watch_timeout_seconds: int = 300,
        retry_seconds: float = 1.0,
        max_retry_seconds: float = 30.0,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.name = name or getattr(resource, "__name__", "objects")
        self.store: Store[T] = Store(parse, max_objects, self.name, max_per_namespace)
        self.on_change = on_change
        self.watch_timeout_seconds = watch_timeout_seconds
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.synced = asyncio.Event()
        self._version: str | None = None  # the last version seen: where a watch resumes
        #: complete lists done (the first, and one per 410 Gone or overflow)
        self.lists = 0
        self._listed_at = 0.0
        #: the least seconds between two lists made because a deletion made room in a
        #: namespace at its cap (a tenant deleting and creating objects at its cap cannot make
        #: the operator list everything over and over)
        self.overflow_list_seconds = 30.0

    def get(self, key: Key) -> T | None:
        """The cached object under ``key``, or None."""
        return self.store.get(key)

    def values(self) -> list[T]:
        """Every cached object, in key order."""
        return self.store.values()

    def written(self, raw: dict[str, Any]) -> None:
        """Put the object a write returned into the cache now (see the module docstring). Call
        it on the cache whose selector the written object matches."""
        self.store.written(raw)

    def mark(self, key: Key, change: Callable[[T], T]) -> bool:
        """:meth:`Store.mark` on this cache's store."""
        return self.store.mark(key, change)

    def _notify(self, keys: Iterable[Key]) -> None:
        """Tell ``on_change`` about each key."""
        if self.on_change is not None:
            for key in keys:
                self.on_change(key)

    def _params(self) -> dict[str, Any]:
        """Namespace and selectors, as lightkube's list and watch take them."""
        out: dict[str, Any] = {"labels": self.labels, "fields": self.fields}
        if self.namespace is not None:
            out["namespace"] = self.namespace
        return out

    async def relist(self) -> str:
        """List every object now and replace the cache's content. Returns the list's
        resourceVersion (where a watch continues). Raises lightkube's ``ApiError``."""
        listing = self.client.list(self.resource, chunk_size=500, **self._params())
        objects = [obj.to_dict() async for obj in listing]
        version = listing.resourceVersion  # set by the first chunk, even an empty one
        changed = self.store.replace(objects)
        self.lists += 1
        self._listed_at = time.monotonic()
        self.synced.set()
        self._notify(sorted(changed))
        return version

    async def _follow(self, version: str) -> str | None:
        """Watch from ``version``, applying events. Returns None when a new list is due (the
        store has room for objects it left out); raises on a failure, ``ApiError`` 410
        included. Keeps ``self._version`` at the last version seen."""
        self._version = version
        async for kind, obj in self.client.watch(
            self.resource,
            resource_version=version,
            server_timeout=self.watch_timeout_seconds,
            on_error=on_error_raise,
            **self._params(),
        ):
            raw = obj.to_dict()
            self._version = version_of(raw) or self._version
            if self.store.apply(kind, raw):
                self._notify([key_of(raw)])
            room = self.store.room_for_dropped(key_of(raw)[0]) if kind == "DELETED" else None
            if room == "store" or (
                room == "namespace"
                and time.monotonic() - self._listed_at >= self.overflow_list_seconds
            ):
                return None  # list again for what was left out
        return self._version  # pragma: no cover - lightkube's watch reconnects by itself

    async def run(self, resource_version: str | None = None) -> None:
        """Keep the cache current until cancelled. ``resource_version``: continue watching from
        there instead of listing first (only for a store that holds that version's list)."""
        version = resource_version
        delay = self.retry_seconds
        while True:
            try:
                if version is None:
                    version = await self.relist()
                version = await self._follow(version)
                delay = self.retry_seconds
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status.code == 410:
                    log.info("%s: watch expired (410 Gone); listing again", self.name)
                    version = None
                    continue
                log.warning("%s: watch failed: %s", self.name, e.status.message)
                version = self._version
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_retry_seconds)
            except Exception as e:  # connection lost, API server restarting, ...
                log.warning("%s: watch failed (%s); retrying", self.name, type(e).__name__)
                version = self._version
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_retry_seconds)
