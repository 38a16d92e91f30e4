"""Warm-pool schedules (pure): windows in which a pool keeps more idle runners.

Each window opens whenever its ``start`` cron expression matches and closes
whenever its ``end`` matches, read as wall-clock times in its ``timeZone`` (the KEDA cron
scaler's start/end model). While windows are open the largest of their ``minIdle`` replaces
``scaling.minIdle``, in both modes. A window is open at ``now`` when the latest ``start`` match
at or before ``now`` is later than the latest ``end`` match at or before ``now``: opening is
inclusive and closing exclusive. Across a daylight-saving change croniter's reading of local
time applies: a time skipped in spring matches at the first instant after the gap (when that
makes a start and an end coincide, the one whose own time it is counts as later, so a window
closed from 02:00 to 03:00 stays open on the day that hour is skipped); a time repeated in
autumn matches both times, which cannot reopen a closed window because only the latest match
counts.

Every datetime must be timezone-aware.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from impvm.api.models import WarmPoolSchedule
from impvm.api.times import require_aware

__all__ = ["Schedule", "open_schedule"]

#: First instant from which a schedule's expressions must match at least once (validation).
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------------------------
# Schedules


#: Widest daylight-saving shift of any zone (Antarctica/Troll: 2 h) with a margin.
_DST_MARGIN = timedelta(hours=3)
#: Bound on the matches stepped through near a daylight-saving change.
_MAX_STEPS = 2000


def _near_transition(zone: ZoneInfo, t: datetime) -> bool:
    return (t - _DST_MARGIN).astimezone(zone).utcoffset() != (t + _DST_MARGIN).astimezone(
        zone
    ).utcoffset()


def _last_match(expr: str, zone: ZoneInfo, now: datetime) -> datetime | None:
    """The latest instant at or before ``now`` at which ``expr`` matches in ``zone`` (None:
    none found).

    croniter's backward step reads wall-clock time, which is ambiguous in the hour repeated in
    autumn (02:15 after the change looks earlier than 02:30 before it). Away from a
    daylight-saving change that reading is exact; near one, the matches are stepped through
    forwards from a base well before both the change and ``now``, in instants, which croniter
    gets right (both 02:30s of the repeated hour, and the first instant after a spring gap)."""
    local = now.astimezone(zone)
    try:
        guess = croniter(expr, local + timedelta(microseconds=1)).get_prev(datetime)
    except CroniterBadDateError:
        return None
    if not _near_transition(zone, now) and not _near_transition(zone, guess):
        return guess
    base = min(guess, now) - 2 * _DST_MARGIN
    while _near_transition(zone, base):
        base -= 2 * _DST_MARGIN
    it = croniter(expr, base.astimezone(zone))
    best: datetime | None = None
    for _ in range(_MAX_STEPS):
        t = it.get_next(datetime)
        if t > now:
            break
        best = t if best is None or t > best else best
    return best


def _on_the_clock(expr: str, t: datetime) -> bool:
    """Whether ``expr`` matches ``t``'s own wall-clock time (False for a match moved out of a
    spring gap)."""
    return bool(croniter.match(expr, t.replace(tzinfo=None)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """One ``scaling.warmPool.schedules`` window (see the module docstring)."""

    name: str
    start: str
    end: str
    zone: ZoneInfo
    min_idle: int

    @classmethod
    def from_spec(cls, spec: WarmPoolSchedule, where: str) -> Schedule:
        """Check and convert one window; ``where`` is its path (``spec.scaling.warmPool.
        schedules[0]``). Raises ValueError naming the field for an unknown time zone, a cron
        expression croniter refuses, or one that never matches."""
        try:
            zone = ZoneInfo(spec.time_zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{where}.timeZone: unknown time zone {spec.time_zone!r}") from None
        for key, expr in (("start", spec.start), ("end", spec.end)):
            if not croniter.is_valid(expr):
                raise ValueError(f"{where}.{key}: not a cron expression: {expr!r}")
            try:
                croniter(expr, _EPOCH.astimezone(zone)).get_next(datetime)
            except (CroniterBadDateError, CroniterBadCronError):
                raise ValueError(f"{where}.{key}: {expr!r} never matches") from None
        return cls(
            name=spec.name, start=spec.start, end=spec.end, zone=zone, min_idle=spec.min_idle
        )

    def is_open(self, now: datetime) -> bool:
        """Whether the window is open at ``now`` (timezone-aware)."""
        require_aware("now", now)
        opened = _last_match(self.start, self.zone, now)
        if opened is None:
            return False
        closed = _last_match(self.end, self.zone, now)
        if closed is None or opened > closed:
            return True
        if opened < closed:
            return False
        # both at one instant: one of them was a time skipped in spring, moved to the first
        # instant after the gap; the one whose own time it really is came later on the clock
        return _on_the_clock(self.start, opened) and not _on_the_clock(self.end, closed)


def open_schedule(schedules: tuple[Schedule, ...], now: datetime) -> Schedule | None:
    """The open window with the largest ``min_idle`` at ``now`` (the first such in list order),
    or None when no window is open."""
    best: Schedule | None = None
    for s in schedules:
        if s.is_open(now) and (best is None or s.min_idle > best.min_idle):
            best = s
    return best


# --------------------------------------------------------------------------------------------
# Policy, events, state
