"""``status.conditions`` with Kubernetes API conventions: type, status, reason, message,
lastTransitionTime (changes only when status flips), observedGeneration."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from impvm.api.times import k8s_time


class ConditionSet:
    """Mutable set of conditions of one object, keyed by type."""

    def __init__(self, items: Iterable[dict[str, Any]], generation: int) -> None:
        self.generation = generation
        self._items: dict[str, dict[str, Any]] = {c["type"]: dict(c) for c in items}
        self.touched: set[str] = set()

    @classmethod
    def from_status(cls, status: dict[str, Any] | None, generation: int) -> ConditionSet:
        """Conditions from an object's ``status`` (may be None)."""
        return cls((status or {}).get("conditions") or [], generation)

    def set(self, type_: str, status: bool, reason: str, message: str) -> bool:
        """Set one condition. Returns True when its status changed (a transition worth an
        Event); lastTransitionTime moves only then."""
        value = "True" if status else "False"
        self.touched.add(type_)
        old = self._items.get(type_)
        changed = old is None or old.get("status") != value
        self._items[type_] = {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message[:1024],
            "lastTransitionTime": k8s_time()
            if changed or old is None
            else old["lastTransitionTime"],
            "observedGeneration": self.generation,
        }
        return changed and (status or old is not None)

    def is_true(self, type_: str) -> bool:
        """Whether the condition exists and is True."""
        c = self._items.get(type_)
        return bool(c and c["status"] == "True")

    def reason_of(self, type_: str, reasons: Iterable[str]) -> bool:
        """Whether the condition currently has one of ``reasons``."""
        c = self._items.get(type_)
        return bool(c and c.get("reason") in set(reasons))

    def merged_into(self, current: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``current`` conditions (as stored now, possibly written by another controller since
        this set was read) with the types this set touched replaced by ours."""
        out = {c["type"]: c for c in current}
        for t in self.touched:
            out[t] = self._items[t]
        return [out[k] for k in sorted(out)]

    def as_list(self) -> list[dict[str, Any]]:
        """The conditions, sorted by type (stable output for merge patches)."""
        return [self._items[k] for k in sorted(self._items)]
