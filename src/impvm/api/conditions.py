"""``status.conditions`` with Kubernetes API conventions: type, status, reason, message,
lastTransitionTime (changes only when status flips), observedGeneration. Pure: the time of a
transition is passed in."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from impvm.api.times import k8s_time

#: Longest condition message written (the API allows 32768; a person reads a sentence).
MAX_MESSAGE = 1024


class ConditionSet:
    """Mutable set of conditions of one object, keyed by type, as one writer sees them."""

    def __init__(self, items: Iterable[Mapping[str, Any]], generation: int) -> None:
        self.generation = generation
        self._items: dict[str, dict[str, Any]] = {c["type"]: dict(c) for c in items}
        self.touched: set[str] = set()

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None, generation: int) -> ConditionSet:
        """Conditions from an object's ``status`` (may be None)."""
        return cls((status or {}).get("conditions") or [], generation)

    def set(self, type_: str, status: bool, reason: str, message: str, now: dt.datetime) -> bool:
        """Set one condition at time ``now``. Returns True when its status changed to a value
        worth an Event (any change, or a first condition that is True); lastTransitionTime
        moves only on a change of status."""
        value = "True" if status else "False"
        self.touched.add(type_)
        old = self._items.get(type_)
        changed = old is None or old.get("status") != value
        self._items[type_] = {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "lastTransitionTime": old["lastTransitionTime"]
            if old is not None and not changed
            else k8s_time(now),
            "observedGeneration": self.generation,
        }
        return changed and (status or old is not None)

    def ours(self) -> list[dict[str, Any]]:
        """The conditions this writer set, sorted by type."""
        return [self._items[t] for t in sorted(self.touched)]

    def merged_into(self, current: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``current`` conditions (as stored now, possibly written by another controller since
        this set was read) with the types this set touched replaced by ours."""
        out = {c["type"]: dict(c) for c in current}
        for t in self.touched:
            out[t] = self._items[t]
        return [out[k] for k in sorted(out)]

    def as_list(self) -> list[dict[str, Any]]:
        """The conditions, sorted by type (stable output for merge patches)."""
        return [self._items[k] for k in sorted(self._items)]


def merge_conditions(
    current: Iterable[Mapping[str, Any]], ours: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``current`` with each of ``ours`` replacing the condition of its type; sorted by type."""
    out = {c["type"]: dict(c) for c in current}
    for c in ours:
        out[c["type"]] = dict(c)
    return [out[k] for k in sorted(out)]
