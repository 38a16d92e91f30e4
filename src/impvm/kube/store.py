"""The in-memory part of a watch cache (:class:`Store`, no I/O): objects by ``(namespace,
name)``, parsed once, bounded in all and per namespace, with own writes kept ahead of older watch
events (the rules are in :mod:`impvm.kube.watchcache`); and :class:`GroupIndex`, the names of
cached objects by (namespace, group) kept in step with one store."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

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


def version_of(raw: dict[str, Any]) -> str:
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
            if old is not None and old.version == version_of(raw):
                fresh[key] = _Slot(old.value, old.version)
                fresh[key].seen.append(old.version)
                per_ns[key[0]] = per_ns.get(key[0], 0) + 1
                continue
            value = self._parse(raw)
            if value is not None:
                fresh[key] = _Slot(value, version_of(raw))
                fresh[key].seen.append(version_of(raw))
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
        version = version_of(raw)
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
        version = version_of(raw)
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


class GroupIndex:
    """Names of cached objects by (namespace, group) (e.g. the VMs of each pool), kept in step
    with one cache by calling :meth:`update` on each of its changes."""

    def __init__(self) -> None:
        self.by_group: dict[tuple[str, str], set[str]] = {}
        self.group_of: dict[Key, str] = {}

    def update(self, key: Key, group: str | None) -> tuple[str | None, str | None]:
        """Record that ``key`` now belongs to ``group`` (None: gone). Returns (old, new)."""
        old = self.group_of.get(key)
        if old == group:
            return old, group
        if old is not None:
            names = self.by_group.get((key[0], old))
            if names is not None:
                names.discard(key[1])
                if not names:
                    del self.by_group[(key[0], old)]
            del self.group_of[key]
        if group is not None:
            self.group_of[key] = group
            self.by_group.setdefault((key[0], group), set()).add(key[1])
        return old, group

    def names(self, namespace: str, group: str) -> list[str]:
        """The names of ``group`` in ``namespace``, sorted."""
        return sorted(self.by_group.get((namespace, group), ()))
