"""Go duration strings (``1h30m``, ``90s``, ``0s``), as accepted by CEL's ``duration()`` and by
``expireAfter`` fields."""

from __future__ import annotations

import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string. Raises ``ValueError`` for anything else."""
    pos = 0
    total = 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration: {text!r}")
    return total


def resolve_expire_after(*candidates: str | None) -> float | None:
    """The first set ``expireAfter`` among ``candidates`` (VM, then pool, then template), in
    seconds; ``None`` when none is set or the first set one is ``0s`` (no deadline)."""
    for c in candidates:
        if c:
            seconds = parse_duration(c)
            return seconds or None
    return None
