"""Job traces: what the simulator replays, how they are read and written, and a generator.

A trace is a list of workflow jobs, each with the time it was queued, its ``runs-on`` labels and
how long it ran once started. Two file forms:

* CSV with the header ``queued_at,labels,duration_seconds`` (other columns are ignored):
  ``queued_at`` an ISO 8601 timestamp with a time zone (``2026-03-02T08:00:00Z``), ``labels``
  separated by spaces (GitHub labels contain no whitespace), ``duration_seconds`` a number >= 0;
* JSON: a list of objects with the same keys (``labels`` a list of strings), or an object whose
  ``jobs`` key holds that list.

:func:`load_trace` raises :class:`TraceError` whose message is one line naming the file, the row
(CSV: its line number; JSON: its index) and the field. :func:`generate` makes a bursty working
day (a quiet night, a morning ramp, a busy day with a lunch dip, a burst of jobs, an evening
decline) from a seed, so the same seed always gives the same trace.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "COLUMNS",
    "DayProfile",
    "TraceError",
    "TraceJob",
    "dump_trace",
    "generate",
    "load_trace",
    "parse_trace",
]

#: CSV header of a trace.
COLUMNS = ("queued_at", "labels", "duration_seconds")


class TraceError(ValueError):
    """A trace file that cannot be used; the message is one line naming the row and field."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One workflow job: queued at ``queued_at`` (aware), ``runs-on`` ``labels``, running
    ``duration_seconds`` once a runner started it."""

    queued_at: datetime
    labels: tuple[str, ...]
    duration_seconds: float


Label = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^,\s]+$")]


class _Row(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    queued_at: AwareDatetime
    labels: list[Label] = Field(min_length=1)
    duration_seconds: float = Field(ge=0, allow_inf_nan=False)


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"]) or "row"
    return f"{field}: {err['msg']}"


def _rows_csv(text: str, name: str) -> Iterable[tuple[str, dict[str, Any]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(
            f"{name}: missing column {', '.join(missing)} (header: {','.join(header)})"
        )
    for row in reader:
        where = f"{name} line {reader.line_num}"
        if None in row:
            raise TraceError(f"{where}: more fields than the header has")
        labels = row.get("labels")
        yield where, {**row, "labels": labels.split() if isinstance(labels, str) else labels}


def _rows_json(text: str, name: str) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{name}: not JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
    prefix = ""
    if isinstance(data, dict):
        if "jobs" not in data:
            raise TraceError(f"{name}: expected a list of jobs or an object with a 'jobs' list")
        data, prefix = data["jobs"], "jobs"
    if not isinstance(data, list):
        raise TraceError(f"{name}: {prefix or 'the document'} must be a list of jobs")
    for i, item in enumerate(data):
        where = f"{name} {prefix}[{i}]"
        if not isinstance(item, dict):
            raise TraceError(f"{where}: must be an object with {', '.join(COLUMNS)}")
        yield where, item


def parse_trace(text: str, name: str, fmt: str = "csv") -> list[TraceJob]:
    """Parse a trace (``fmt`` ``csv`` or ``json``) into jobs sorted by queued time.

    ``name`` names the source in error messages. Raises :class:`TraceError` (one line naming
    the row and field) for a malformed file, a bad value or an empty trace.
    """
    rows = _rows_json(text, name) if fmt == "json" else _rows_csv(text, name)
    jobs: list[TraceJob] = []
    for where, raw in rows:
        try:
            row = _Row.model_validate(raw)
        except ValidationError as e:
            raise TraceError(f"{where}: {_first_error(e)}") from None
        jobs.append(TraceJob(row.queued_at, tuple(row.labels), row.duration_seconds))
    if not jobs:
        raise TraceError(f"{name}: no jobs")
    jobs.sort(key=lambda j: j.queued_at)
    return jobs


def load_trace(path: Path) -> list[TraceJob]:
    """Read a trace file: JSON when its name ends in ``.json``, CSV otherwise. Raises
    :class:`TraceError` (one line) when it cannot be read or used."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read: {e}") from None
    return parse_trace(text, str(path), "json" if path.suffix.lower() == ".json" else "csv")


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dump_trace(jobs: Sequence[TraceJob], fmt: str = "csv") -> str:
    """The trace as CSV (header :data:`COLUMNS`) or JSON text; :func:`parse_trace` reads it
    back unchanged (times to the millisecond, durations to 0.1 s)."""
    if fmt == "json":
        items = [
            {
                "queued_at": _iso(j.queued_at),
                "labels": list(j.labels),
                "duration_seconds": round(j.duration_seconds, 1),
            }
            for j in jobs
        ]
        return json.dumps(items, indent=0) + "\n"
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    for j in jobs:
        w.writerow((_iso(j.queued_at), " ".join(j.labels), f"{j.duration_seconds:.1f}"))
    return out.getvalue()


# --------------------------------------------------------------------------------------------
# Generator


@dataclass(frozen=True, slots=True, kw_only=True)
class DayProfile:
    """A working day's job arrivals (rates in jobs per minute; hours of the day in ``start``'s
    time zone).

    Night (before ``ramp_from`` and after ``evening_to``) at ``night_per_hour`` jobs/hour; a
    linear morning ramp from ``ramp_from`` to ``ramp_to`` up to ``peak_per_minute``; the peak
    until ``evening_from`` except a lunch dip to ``lunch_share`` of it between ``lunch_from`` and
    ``lunch_to``; a linear decline to the night rate by ``evening_to``. On top, ``burst_size``
    jobs queued within ``burst_seconds`` from ``burst_at`` (a large matrix workflow). Durations
    are lognormal with median ``duration_median_seconds`` and 95th percentile
    ``duration_p95_seconds``.
    """

    start: datetime = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday
    days: int = 1
    night_per_hour: float = 3.0
    ramp_from: float = 7.0
    ramp_to: float = 10.0
    peak_per_minute: float = 8.0
    lunch_from: float = 12.0
    lunch_to: float = 13.0
    lunch_share: float = 0.6
    evening_from: float = 17.0
    evening_to: float = 20.0
    burst_size: int = 200
    burst_at: float = 14.5
    burst_seconds: float = 60.0
    duration_median_seconds: float = 240.0
    duration_p95_seconds: float = 1200.0
    labels: tuple[str, ...] = ("self-hosted", "imp")

    def __post_init__(self) -> None:
        if self.start.utcoffset() is None:
            raise ValueError("start must be timezone-aware")
        if not (0 <= self.ramp_from <= self.ramp_to <= self.evening_from <= self.evening_to <= 24):
            raise ValueError("hours must satisfy 0 <= ramp_from <= ramp_to <= evening_from <= 24")
        if self.days < 1 or self.burst_size < 0 or self.peak_per_minute < 0:
            raise ValueError("days must be >= 1, burst_size and peak_per_minute >= 0")
        if not 0 < self.duration_median_seconds <= self.duration_p95_seconds:
            raise ValueError("duration_median_seconds must be > 0 and <= duration_p95_seconds")

    def rate_per_minute(self, hour: float) -> float:
        """Arrival rate (jobs/minute) at ``hour`` of the day (0 <= hour < 24), burst excluded."""
        night = self.night_per_hour / 60.0
        if hour < self.ramp_from or hour >= self.evening_to:
            return night
        if hour < self.ramp_to:
            f = (hour - self.ramp_from) / max(self.ramp_to - self.ramp_from, 1e-9)
            return night + f * (self.peak_per_minute - night)
        if hour < self.evening_from:
            lunch = self.lunch_from <= hour < self.lunch_to
            return self.peak_per_minute * (self.lunch_share if lunch else 1.0)
        f = (hour - self.evening_from) / max(self.evening_to - self.evening_from, 1e-9)
        return self.peak_per_minute + f * (night - self.peak_per_minute)


def _lognormal(rng: random.Random, median: float, p95: float) -> float:
    sigma = math.log(p95 / median) / 1.6448536269514722
    return rng.lognormvariate(math.log(median), sigma)


def generate(profile: DayProfile, seed: int) -> list[TraceJob]:
    """A trace of ``profile`` from ``seed`` (same seed, same trace), sorted by queued time.

    Arrivals outside the burst are a non-homogeneous Poisson process (thinning: candidates at
    the peak rate, each kept with probability rate/peak)."""
    rng = random.Random(seed)
    top = max(profile.peak_per_minute, profile.night_per_hour / 60.0) / 60.0  # jobs/second
    midnight = profile.start.replace(hour=0, minute=0, second=0, microsecond=0)
    span = profile.days * 86400.0
    times: list[float] = []
    t = 0.0
    while top > 0:
        t += rng.expovariate(top)
        if t >= span:
            break
        hour = (t % 86400.0) / 3600.0
        if rng.random() * top <= profile.rate_per_minute(hour) / 60.0:
            times.append(t)
    for day in range(profile.days):
        at = day * 86400.0 + profile.burst_at * 3600.0
        times.extend(at + rng.random() * profile.burst_seconds for _ in range(profile.burst_size))
    times.sort()
    return [
        TraceJob(
            queued_at=midnight + timedelta(seconds=round(s, 3)),
            labels=profile.labels,
            duration_seconds=round(
                _lognormal(rng, profile.duration_median_seconds, profile.duration_p95_seconds), 1
            ),
        )
        for s in times
    ]
