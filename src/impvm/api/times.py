"""Timestamps as Kubernetes writes them (``metav1.Time``: RFC 3339, UTC, whole seconds)."""

from __future__ import annotations

import datetime as dt


def utcnow() -> dt.datetime:
    """The current time, timezone-aware (UTC)."""
    return dt.datetime.now(dt.UTC)


def k8s_time(t: dt.datetime | None = None) -> str:
    """``t`` (default: now) as ``2026-11-30T12:00:00Z``."""
    return (t or utcnow()).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
