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


def condition(
    old: Mapping[str, Any] | None,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int | None = None,
) -> dict[str, Any]:
    """Condition ``type_`` set at ``now`` (wire form), after ``old`` (its previous value, if
    any): lastTransitionTime moves only when the status flips; the message is cut to
    :data:`MAX_MESSAGE`; ``observedGeneration`` when a ``generation`` is given."""
    value = "True" if status else "False"
    keep = old is not None and old.get("status") == value and old.get("lastTransitionTime")
    out: dict[str, Any] = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": old["lastTransitionTime"] if keep and old else k8s_time(now),
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def set_condition(
    conditions: Iterable[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """``conditions`` (wire form) with ``type_`` set (:func:`condition`), sorted by type."""
    out = {c["type"]: dict(c) for c in conditions}
    out[type_] = condition(out.get(type_), type_, status, reason, message, now, generation)
    return [out[k] for k in sorted(out)]


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
        self.touched.add(type_)
        old = self._items.get(type_)
        changed = old is None or old.get("status") != ("True" if status else "False")
        self._items[type_] = condition(old, type_, status, reason, message, now, self.generation)
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
