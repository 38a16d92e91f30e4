"""Timestamps as Kubernetes writes them (``metav1.Time``: RFC 3339, UTC, whole seconds) and the
one clock a component reads.

A :class:`Clock` gives both readings a component needs from one source: ``monotonic()`` (seconds,
for delays: backoff, poll intervals, caches) and ``now()`` (a timezone-aware UTC datetime, for
what is compared with Kubernetes timestamps: cooldown, bootstrap timeouts, Lease expiry). A test
that moves the clock moves both.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable


def utcnow() -> dt.datetime:
    """The current time, timezone-aware (UTC)."""
    return dt.datetime.now(dt.UTC)


def k8s_time(t: dt.datetime | None = None) -> str:
    """``t`` (default: now) as ``2026-11-30T12:00:00Z``."""
    return (t or utcnow()).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def require_aware(what: str, value: dt.datetime | None) -> None:
    """Raise ``ValueError`` naming ``what`` when ``value`` is a naive datetime (None passes)."""
    if value is not None and value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {value!r}")


def parse_time(raw: object) -> dt.datetime | None:
    """A timestamp as the API server or GitHub writes it (RFC 3339: ``2026-11-30T12:00:00Z``,
    fractions and offsets allowed) as an aware datetime; a datetime is returned as it is (an
    aware one), None or ``""`` as None. The one parser of timestamps in the project.

    Raises ValueError for anything else: not a string, not RFC 3339, or without a timezone
    (a time of unknown zone cannot be compared)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, dt.datetime):
        parsed = raw
    elif isinstance(raw, str):
        parsed = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    else:
        raise ValueError(f"expected an RFC 3339 time, got {raw!r}")
    if parsed.utcoffset() is None:
        raise ValueError(f"time without a timezone: {raw!r}")
    return parsed


@runtime_checkable
class Clock(Protocol):
    """Monotonic seconds and wall time from one source."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    def now(self) -> dt.datetime:
        """Wall time, timezone-aware (UTC)."""
        ...


class SystemClock:
    """The host's clocks: ``time.monotonic`` and the UTC wall clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> dt.datetime:
        return utcnow()


class DerivedClock:
    """Wall time derived from a monotonic source: ``now()`` is the wall time at construction
    plus the seconds ``monotonic`` has advanced since. Inject a controllable ``monotonic``
    (a test's fake clock) and both readings move together."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._anchor_mono = monotonic()
        self._anchor_wall = utcnow()

    def monotonic(self) -> float:
        return self._monotonic()

    def now(self) -> dt.datetime:
        return self._anchor_wall + dt.timedelta(seconds=self._monotonic() - self._anchor_mono)


def as_clock(source: Clock | Callable[[], float] | None) -> Clock:
    """A :class:`Clock` from a clock, a bare monotonic function (see :class:`DerivedClock`) or
    None (the system clock)."""
    if source is None:
        return SystemClock()
    if isinstance(source, Clock):
        return source
    return DerivedClock(source)
