"""What the reaper reads and how it reads a VM's job record: GitHub's workflow run and job
(:class:`RunInfo`, :class:`JobInfo`), the record's run id and repository as GitHub names them,
and short durations for its messages. Pure.

GitHub's workflow run ``status`` is ``completed`` for every finished run, whatever its
``conclusion`` (success, failure, **cancelled**, timed_out, skipped, ...); a run has no
``completed_at``, so the time it completed is its ``updated_at`` (REST "Get a workflow run").
A job has ``completed_at`` (REST "Get a job for a workflow run").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from impvm.api.models import REPO_PATTERN
from impvm.api.times import parse_time

__all__ = [
    "DEFAULT_COMPLETED_GRACE_SECONDS",
    "DEFAULT_MAX_JOB_SECONDS",
    "JobInfo",
    "RunInfo",
    "format_duration",
    "parse_repository",
    "parse_run_id",
]

#: Default of ``spec.reaper.completedGraceSeconds``.
DEFAULT_COMPLETED_GRACE_SECONDS = 300
#: Default of ``spec.reaper.maxJobSeconds`` (``ReaperSpec``: 6 hours, GitHub's job limit on
#: hosted runners).
DEFAULT_MAX_JOB_SECONDS = 21600

_REPO_RE = re.compile(REPO_PATTERN)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """A workflow run as GitHub reports it: ``status`` (queued, in_progress, completed, ...),
    ``conclusion`` (None until completed; cancelled is a conclusion of a completed run) and
    ``updated_at`` (when a completed run completed)."""

    status: str
    conclusion: str | None
    updated_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        """Parse GitHub's workflow-run object (fields ``status``, ``conclusion``,
        ``updated_at``). Raises KeyError/ValueError on a missing or unparsable field."""
        return cls(
            status=str(data["status"]),
            conclusion=_opt_str(data.get("conclusion")),
            updated_at=_parse_time(data["updated_at"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    """A workflow job as GitHub reports it: ``status``, ``conclusion``, ``started_at`` and
    ``completed_at`` (None until completed)."""

    status: str
    conclusion: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobInfo:
        """Parse GitHub's workflow-job object. Raises KeyError/ValueError on a missing
        ``status`` or an unparsable time."""
        started = data.get("started_at")
        completed = data.get("completed_at")
        return cls(
            status=str(data["status"]),
            conclusion=_opt_str(data.get("conclusion")),
            started_at=_parse_time(started) if started else None,
            completed_at=_parse_time(completed) if completed else None,
        )


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _parse_time(value: object) -> datetime:
    """A time GitHub wrote (RFC 3339). Raises ValueError when it is missing or not one."""
    if not isinstance(value, str):
        raise ValueError(f"expected an ISO 8601 time, got {value!r}")
    parsed = parse_time(value)
    assert parsed is not None
    return parsed


# --------------------------------------------------------------------------------------------
# Validation of the job record


def parse_run_id(raw: object) -> int | None:
    """The workflow run id as a positive int, or None when ``raw`` is not one.

    Accepts an int (not a bool) or a string of ASCII digits; rejects 0, negatives, floats,
    whitespace and anything else."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw > 0 else None
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        value = int(raw)
        return value if value > 0 else None
    return None


def parse_repository(raw: object) -> str | None:
    """``raw`` if it is a valid GitHub ``owner/name``, else None.

    Owner: 1-39 ASCII letters, digits or hyphens, not starting with a hyphen; name: 1-100 of
    ``[A-Za-z0-9._-]``, and not ``.`` or ``..`` (GitHub's naming rules; the pattern is
    :data:`impvm.api.models.REPO_PATTERN`)."""
    if not isinstance(raw, str) or not _REPO_RE.fullmatch(raw):
        return None
    if raw.split("/", 1)[1] in {".", ".."}:
        return None
    return raw


def format_duration(seconds: float) -> str:
    """A short human duration: ``45s``, ``5m``, ``1h30m``, ``1d``, ``10d2h``: the largest
    non-zero unit and the next one (dropped when zero), truncated; negative values read ``0s``."""
    total = max(0, int(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for i, (unit, size) in enumerate(units):
        if total >= size:
            text = f"{total // size}{unit}"
            if i + 1 < len(units):
                sub_unit, sub_size = units[i + 1]
                sub = (total % size) // sub_size
                if sub:
                    text += f"{sub}{sub_unit}"
            return text
    return "0s"
