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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import on_error_raise

log = logging.getLogger("impvm.kube.watchcache")

T = TypeVar("T")

#: ``(namespace, name)``; the namespace is ``""`` for a cluster-scoped object.
Key = tuple[str, str]
#: How many of an object's last resourceVersions the watch delivered are remembered (an own
#: write is answered long before that many more changes of the same object arrive).
SEEN_VERSIONS = 16
#: How many uids of deleted objects are remembered (see :meth:`Store.written`).
GONE_UIDS = 4096


def key_of(raw: dict[str, Any]) -> Key:
    """The key of an object (a dict as the API server sends it)."""
    meta = raw.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _uid(raw: dict[str, Any]) -> str:
    return str((raw.get("metadata") or {}).get("uid") or "")


def _version(raw: dict[str, Any]) -> str:
    return str((raw.get("metadata") or {}).get("resourceVersion") or "")


@dataclass
class _Slot(Generic[T]):
    value: T
    version: str
    #: resourceVersion of this process's own write, not yet delivered by the watch
    pending: str | None = None
    #: the object's last resourceVersions delivered by the list or the watch, newest last
    seen: deque[str] = field(default_factory=lambda: deque(maxlen=SEEN_VERSIONS))


class Store(Generic[T]):
    """The objects of a cache, by key (no I/O). ``parse`` turns an object dict into ``T`` (it
    may raise to reject one); ``max_objects`` bounds the number held."""

    def __init__(
        self,
        parse: Callable[[dict[str, Any]], T],
        max_objects: int,
        name: str = "",
        max_per_namespace: int | None = None,
    ) -> None:
        self.parse = parse
        self.max_objects = max_objects
        self.max_per_namespace = max_per_namespace
        self.name = name
        #: objects held per namespace
        self._per_ns: dict[str, int] = {}
        #: what objects were left out for: the namespace's cap, or the whole store's
        self._dropped_ns: set[str] = set()
        self._dropped_full = False
        #: objects left out because the cache was full (since the last complete list)
        self.dropped = 0
        self._slots: dict[Key, _Slot[T]] = {}
        #: uids of the objects the watch reported deleted (the last :data:`GONE_UIDS`): a write
        #: answered after its object's deletion was delivered must not bring it back
        self._gone: dict[str, None] = {}

    def get(self, key: Key) -> T | None:
        """The object stored under ``key``, or None."""
        slot = self._slots.get(key)
        return slot.value if slot else None

    def version(self, key: Key) -> str | None:
        """The resourceVersion stored under ``key``, or None."""
        slot = self._slots.get(key)
        return slot.version if slot else None

    def keys(self) -> list[Key]:
        """Every key, sorted."""
        return sorted(self._slots)

    def values(self) -> list[T]:
        """Every object, in key order."""
        return [self._slots[k].value for k in sorted(self._slots)]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def _parse(self, raw: dict[str, Any]) -> T | None:
        """The parsed object, or None (logged by name) when ``parse`` rejects it."""
        try:
            return self.parse(raw)
        except Exception as e:  # one bad object must not stop the cache
            log.warning("%s: ignoring %s/%s: %s", self.name, *key_of(raw), type(e).__name__)
            return None

    def replace(self, objects: Iterable[dict[str, Any]]) -> set[Key]:
        """Make the store hold exactly ``objects`` (a complete list; at most ``max_objects`` of
        them, the rest counted in ``dropped``). Returns the keys that were added, changed or
        removed. Pending writes are forgotten: a list is newer than any of them."""
        fresh: dict[Key, _Slot[T]] = {}
        per_ns: dict[str, int] = {}
        self.dropped = 0
        self._dropped_ns, self._dropped_full = set(), False
        for raw in objects:
            key = key_of(raw)
            whole = len(fresh) >= self.max_objects
            if whole or self._ns_full(per_ns, key[0]):
                self._left_out(key[0], whole)
                continue
            old = self._slots.get(key)
            if old is not None and old.version == _version(raw):
                fresh[key] = _Slot(old.value, old.version)
                fresh[key].seen.append(old.version)
                per_ns[key[0]] = per_ns.get(key[0], 0) + 1
                continue
            value = self._parse(raw)
            if value is not None:
                fresh[key] = _Slot(value, _version(raw))
                fresh[key].seen.append(_version(raw))
                per_ns[key[0]] = per_ns.get(key[0], 0) + 1
        if self.dropped:
            log.warning("%s: full (%d objects); %d left out", self.name, len(fresh), self.dropped)
        changed = {k for k in fresh if self.version(k) != fresh[k].version}
        changed |= set(self._slots) - set(fresh)
        self._slots = fresh
        self._per_ns = per_ns
        return changed

    def _ns_full(self, per_ns: dict[str, int], namespace: str) -> bool:
        cap = self.max_per_namespace
        return cap is not None and per_ns.get(namespace, 0) >= cap

    def _add(self, key: Key, slot: _Slot[T]) -> None:
        if key not in self._slots:
            self._per_ns[key[0]] = self._per_ns.get(key[0], 0) + 1
        self._slots[key] = slot

    def _pop(self, key: Key) -> _Slot[T] | None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            left = self._per_ns.get(key[0], 1) - 1
            if left:
                self._per_ns[key[0]] = left
            else:
                self._per_ns.pop(key[0], None)
        return slot

    def apply(self, kind: str, raw: dict[str, Any]) -> bool:
        """Apply one watch event (``ADDED``, ``MODIFIED``, ``DELETED``). Returns whether the
        store changed."""
        key = key_of(raw)
        if kind == "DELETED":
            self._forget(raw)
            return self._pop(key) is not None
        version = _version(raw)
        slot = self._slots.get(key)
        if slot is not None:
            slot.seen.append(version)
        if slot is not None and slot.pending is not None:
            if version != slot.pending:
                return False  # older than this process's own write, which is stored already
            slot.pending = None
            return False
        if slot is not None and slot.version == version:
            return False
        whole = len(self._slots) >= self.max_objects
        if slot is None and (whole or self._ns_full(self._per_ns, key[0])):
            self._left_out(key[0], whole)
            log.warning("%s: full (%d objects); %s/%s left out", self.name, len(self), *key)
            return False
        value = self._parse(raw)
        if value is None:
            return self._pop(key) is not None
        new = _Slot(value, version)
        new.seen.extend(slot.seen if slot is not None else (version,))
        self._add(key, new)
        return True

    def written(self, raw: dict[str, Any]) -> None:
        """Store the object a write of this process returned (see the module docstring). Such
        an object is kept even when the store is full: it is one this process works on."""
        key = key_of(raw)
        version = _version(raw)
        slot = self._slots.get(key)
        if slot is not None and (slot.version == version or version in slot.seen):
            return  # the watch delivered this version already: the store is at least as new
        if slot is None and _uid(raw) in self._gone:
            return  # deleted, and the watch said so before this write's answer came
        value = self._parse(raw)
        if value is not None:
            new = _Slot(value, version, pending=version)
            if slot is not None:
                new.seen.extend(slot.seen)
            self._add(key, new)

    def mark(self, key: Key, change: Callable[[T], T]) -> bool:
        """Replace the object under ``key`` by ``change(object)``, keeping its resourceVersion:
        for a write whose answer carries no object (a deletion), the next version the watch
        delivers replaces the marked one. Returns whether ``key`` was stored."""
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.value = change(slot.value)
        return True

    def _forget(self, raw: dict[str, Any]) -> None:
        uid = _uid(raw)
        if uid:
            self._gone[uid] = None
            while len(self._gone) > GONE_UIDS:
                del self._gone[next(iter(self._gone))]

    @property
    def has_room_for_dropped(self) -> bool:
        """Objects were left out and there is room now: a new list would pick them up."""
        return self.dropped > 0 and len(self._slots) < self.max_objects

    def room_for_dropped(self, namespace: str) -> str | None:
        """Whether a deletion in ``namespace`` made room for an object left out: ``"store"``
        when the whole store was full, ``"namespace"`` when that namespace was at its cap, else
        None."""
        if self.dropped == 0 or len(self._slots) >= self.max_objects:
            return None
        if self._dropped_full:
            return "store"
        if namespace in self._dropped_ns and not self._ns_full(self._per_ns, namespace):
            return "namespace"
        return None

    def _left_out(self, namespace: str, whole: bool) -> None:
        self.dropped += 1
        if whole:
            self._dropped_full = True
        else:
            self._dropped_ns.add(namespace)


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
            self._version = _version(raw) or self._version
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
