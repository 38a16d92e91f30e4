"""Warm pool sizing: how many idle runners a pool keeps ready (pure: no I/O, no clock reads).

The pool pass (:func:`impvm.scaling.poolpass.warm_pool`) makes one call and feeds the result
into :func:`impvm.scaling.decide`::

    state = WarmPoolState.from_status(pool.status.warm_pool)
    warm = warm_pool_target(policy, state, events, now)
    limits = PoolLimits(min_idle=warm.target, ...)            # the rest of PoolLimits as before
    status["warmPool"] = warm.status().wire()                 # a patch only when it differs

``policy`` is :meth:`WarmPoolPolicy.from_spec` of ``spec.scaling``; ``events`` are what the pass
observed since ``state.updated_at``: a :class:`JobQueued` per matching job the operator saw queued
(webhook or poll), a :class:`RunnerReady` per VM whose runner was first seen online (seconds from
the VM's ``creationTimestamp``). Each event carries the time the operator *observed* it, so the
events of successive passes are ordered; events at or before ``state.updated_at`` were already
folded in and are ignored, which makes a pass that crashed before writing the status harmless:
the next one folds the same events again from the old state.

Rules and their sources:

* ``fixed`` (the default): the target is ``scaling.minIdle``, today's behaviour.
* ``adaptive``: after Little's law (L = λW: the mean number of items in a system is their arrival
  rate times the time each spends in it), the runners needed to cover the jobs that arrive while a
  replacement runner boots is λ * W with λ the job arrival rate and W the time-to-ready (VM
  created to runner online). The target is ``ceil(λ̂ * Ŵ * safetyPercent/100)`` clamped to
  ``[minIdle, maxIdle]``, where λ̂ is an exponentially weighted moving average (EWMA) of the
  arrival rate with half-life ``arrivalHalfLifeSeconds`` (continuous in time: it decays between
  arrivals, so a quiet night brings the target down to ``minIdle``) and Ŵ an EWMA of the
  time-to-ready samples with half-life ``readyHalfLifeSamples`` (each sample moves Ŵ by
  ``alpha = 1 - 2^(-1/half-life)`` of the difference). An estimate below
  :data:`ACTIVATION` runners counts as no demand, so a trickle of jobs keeps no runner warm.
  The decider counts starting VMs towards minIdle (``desired = busy + pending + minIdle``), so
  about λW of the target are replacements still booting: the safety factor must exceed 1 for
  runners to be ready when jobs arrive.
* ``schedules``: windows that raise ``minIdle`` while open (:mod:`impvm.scaling.schedules`).

Units: seconds and jobs per minute; every datetime must be timezone-aware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from impvm.api.models import (
    DEFAULT_ARRIVAL_HALF_LIFE_SECONDS,
    DEFAULT_READY_HALF_LIFE_SAMPLES,
    DEFAULT_SAFETY_PERCENT,
    ScalingSpec,
    WarmPoolStatus,
)
from impvm.api.times import require_aware
from impvm.scaling.schedules import Schedule, open_schedule

__all__ = [
    "ACTIVATION",
    "JobQueued",
    "RunnerReady",
    "Schedule",
    "WarmPoolDecision",
    "WarmPoolEvent",
    "WarmPoolPolicy",
    "WarmPoolState",
    "fold_events",
    "open_schedule",
    "warm_pool_target",
]

#: Estimates (runners) below this are treated as no demand: with the default safety factor (2.5),
#: fewer than one job per 25 time-to-ready intervals keeps nobody warm.
ACTIVATION = 0.1

_LN2 = math.log(2.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmPoolPolicy:
    """``spec.scaling.warmPool`` with its defaults applied (see the module docstring).

    - ``min_idle``: ``scaling.minIdle``; ``max_idle``: ``warmPool.maxIdle`` (fixed: min_idle).
    - ``safety``: ``safetyPercent / 100`` (>= 1).
    - ``arrival_half_life_seconds`` (> 0), ``ready_half_life_samples`` (> 0).
    """

    mode: Literal["fixed", "adaptive"] = "fixed"
    min_idle: int
    max_idle: int
    safety: float = DEFAULT_SAFETY_PERCENT / 100
    arrival_half_life_seconds: float = float(DEFAULT_ARRIVAL_HALF_LIFE_SECONDS)
    ready_half_life_samples: float = float(DEFAULT_READY_HALF_LIFE_SAMPLES)
    schedules: tuple[Schedule, ...] = ()

    def __post_init__(self) -> None:
        if self.min_idle < 0 or self.max_idle < 0:
            raise ValueError("min_idle and max_idle must be >= 0")
        if self.safety < 1:
            raise ValueError(f"safety must be >= 1, got {self.safety}")
        if self.arrival_half_life_seconds <= 0 or self.ready_half_life_samples <= 0:
            raise ValueError("half-lives must be > 0")

    @property
    def ready_alpha(self) -> float:
        """Weight of one time-to-ready sample: ``1 - 2^(-1/readyHalfLifeSamples)``."""
        return 1.0 - math.exp2(-1.0 / self.ready_half_life_samples)

    @classmethod
    def from_spec(cls, scaling: ScalingSpec) -> WarmPoolPolicy:
        """The policy of a pool's ``spec.scaling``. Raises ValueError naming the field when
        ``minIdle`` is missing, an adaptive pool has no ``maxIdle``, or a schedule is unusable
        (:meth:`Schedule.from_spec`); the API server's rules reject most of these first."""
        if scaling.min_idle is None:
            raise ValueError("spec.scaling.minIdle required")
        wp = scaling.warm_pool
        if wp is None:
            return cls(min_idle=scaling.min_idle, max_idle=scaling.min_idle)
        schedules = tuple(
            Schedule.from_spec(s, f"spec.scaling.warmPool.schedules[{i}]")
            for i, s in enumerate(wp.schedules or ())
        )
        if wp.mode == "fixed":
            return cls(min_idle=scaling.min_idle, max_idle=scaling.min_idle, schedules=schedules)
        if wp.max_idle is None:
            raise ValueError("spec.scaling.warmPool.maxIdle required when mode is adaptive")
        return cls(
            mode="adaptive",
            min_idle=scaling.min_idle,
            max_idle=wp.max_idle,
            safety=(wp.safety_percent or DEFAULT_SAFETY_PERCENT) / 100,
            arrival_half_life_seconds=float(
                wp.arrival_half_life_seconds or DEFAULT_ARRIVAL_HALF_LIFE_SECONDS
            ),
            ready_half_life_samples=float(
                wp.ready_half_life_samples or DEFAULT_READY_HALF_LIFE_SAMPLES
            ),
            schedules=schedules,
        )


@dataclass(frozen=True, slots=True)
class JobQueued:
    """The operator observed a queued job matching the pool at ``at``."""

    at: datetime

    def __post_init__(self) -> None:
        require_aware("JobQueued.at", self.at)


@dataclass(frozen=True, slots=True)
class RunnerReady:
    """The operator observed at ``at`` that a VM's runner came online ``seconds`` after the VM
    was created (>= 0)."""

    at: datetime
    seconds: float

    def __post_init__(self) -> None:
        require_aware("RunnerReady.at", self.at)
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"RunnerReady.seconds must be finite and >= 0, got {self.seconds}")


WarmPoolEvent = JobQueued | RunnerReady


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmPoolState:
    """What the warm pool carries from pass to pass (``status.warmPool``).

    - ``arrival_rate_per_minute``: the arrival-rate EWMA as of ``updated_at`` (jobs/minute).
    - ``ready_seconds``: the time-to-ready EWMA (seconds), None before the first sample.
    - ``ready_samples``: samples folded into ``ready_seconds``.
    - ``updated_at``: events observed at or before it are folded in; None: nothing yet.
    """

    arrival_rate_per_minute: float = 0.0
    ready_seconds: float | None = None
    ready_samples: int = 0
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        require_aware("updated_at", self.updated_at)
        if self.arrival_rate_per_minute < 0 or self.ready_samples < 0:
            raise ValueError("arrival_rate_per_minute and ready_samples must be >= 0")
        if self.ready_seconds is not None and self.ready_seconds < 0:
            raise ValueError("ready_seconds must be >= 0")

    def rate_at(self, now: datetime, half_life_seconds: float) -> float:
        """The arrival-rate EWMA decayed to ``now`` (jobs/minute); never grows backwards."""
        if self.updated_at is None or self.arrival_rate_per_minute == 0.0:
            return self.arrival_rate_per_minute
        elapsed = max(0.0, (now - self.updated_at).total_seconds())
        return self.arrival_rate_per_minute * math.exp2(-elapsed / half_life_seconds)

    @classmethod
    def from_status(cls, status: WarmPoolStatus | None) -> WarmPoolState:
        """The state stored in ``status.warmPool`` (None or empty: a fresh state)."""
        if status is None:
            return cls()
        return cls(
            arrival_rate_per_minute=status.arrival_rate_per_minute or 0.0,
            ready_seconds=status.ready_seconds,
            ready_samples=status.ready_samples or 0,
            updated_at=status.updated_at,
        )

    def to_status(
        self, *, target: int | None = None, active_schedule: str | None = None
    ) -> WarmPoolStatus:
        """This state as ``status.warmPool`` (with the decision's target and open window)."""
        return WarmPoolStatus(
            arrival_rate_per_minute=self.arrival_rate_per_minute,
            ready_seconds=self.ready_seconds,
            ready_samples=self.ready_samples,
            updated_at=self.updated_at,
            target=target,
            active_schedule=active_schedule,
        )


def fold_events(
    policy: WarmPoolPolicy,
    state: WarmPoolState,
    events: tuple[WarmPoolEvent, ...] | list[WarmPoolEvent],
    now: datetime,
) -> WarmPoolState:
    """``state`` with the new ``events`` folded in, as of ``now``.

    Events at or before ``state.updated_at`` are skipped (already folded). The new
    ``updated_at`` is ``now``, or the latest event's time if that is later (a clock ahead of
    ours), so no event is ever folded in twice. With no new event the very same ``state`` is
    returned, so the caller writes the status only when an event changed it. Folding in the
    same events twice changes nothing; folding in two batches equals folding once (up to float
    rounding).
    """
    require_aware("now", now)
    since = state.updated_at
    fresh = sorted(
        ((e.at, i, e) for i, e in enumerate(events) if since is None or e.at > since),
        key=lambda t: (t[0], t[1]),
    )
    if not fresh:
        return state
    h = policy.arrival_half_life_seconds
    bump = 60.0 * _LN2 / h  # jobs/minute one arrival adds (1/τ with τ = h/ln2)
    alpha = policy.ready_alpha
    rate = state.arrival_rate_per_minute
    at = since if since is not None else fresh[0][0]
    ready = state.ready_seconds
    samples = state.ready_samples
    for t, _, e in fresh:
        if rate:
            rate *= math.exp2(-max(0.0, (t - at).total_seconds()) / h)
        at = max(at, t)
        if isinstance(e, JobQueued):
            rate += bump
        else:
            ready = e.seconds if ready is None else ready + alpha * (e.seconds - ready)
            samples += 1
    if rate:
        rate *= math.exp2(-max(0.0, (now - at).total_seconds()) / h)
    return WarmPoolState(
        arrival_rate_per_minute=rate,
        ready_seconds=ready,
        ready_samples=samples,
        updated_at=max(now, at),
    )


# --------------------------------------------------------------------------------------------
# Decision


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmPoolDecision:
    """The warm pool's answer for one pass.

    - ``target``: idle runners to keep (feed it to ``PoolLimits.min_idle``), within
      ``[floor, ceiling]``.
    - ``state``: the new state (``is`` the old one when no event was folded in).
    - ``floor``: ``scaling.minIdle``, or the open window's; ``ceiling``: ``max(maxIdle, floor)``.
    - ``active_schedule``: name of the open window that set the floor, if any.
    - ``estimate``: ``λ̂ * Ŵ * safety`` in runners (0 in fixed mode).
    - ``reason``: a sentence with the arithmetic.
    """

    target: int
    state: WarmPoolState
    floor: int
    ceiling: int
    active_schedule: str | None
    estimate: float
    reason: str = field(default="")

    def status(self) -> WarmPoolStatus:
        """``status.warmPool`` after this decision."""
        return self.state.to_status(target=self.target, active_schedule=self.active_schedule)


def warm_pool_target(
    policy: WarmPoolPolicy,
    state: WarmPoolState,
    events: tuple[WarmPoolEvent, ...] | list[WarmPoolEvent],
    now: datetime,
) -> WarmPoolDecision:
    """Decide the warm pool for one pass: ``(policy, state, events since, now) -> (target idle
    runners, new state)`` (see the module docstring for the rules).

    Pure and deterministic. The target is always within ``[floor, max(maxIdle, floor)]``; in
    fixed mode it is the floor; it never decreases when the arrival rate or time-to-ready grow.
    Raises ValueError for a timezone-naive ``now``.
    """
    new_state = fold_events(policy, state, events, now)
    window = open_schedule(policy.schedules, now)
    floor = window.min_idle if window is not None else policy.min_idle
    where = f"window {window.name}" if window is not None else "scaling"
    if policy.mode == "fixed":
        return WarmPoolDecision(
            target=floor,
            state=new_state,
            floor=floor,
            ceiling=floor,
            active_schedule=window.name if window else None,
            estimate=0.0,
            reason=f"fixed: minIdle {floor} ({where})",
        )
    ceiling = max(policy.max_idle, floor)
    rate = new_state.rate_at(now, policy.arrival_half_life_seconds)
    ready = new_state.ready_seconds or 0.0
    estimate = rate / 60.0 * ready * policy.safety
    raw = 0 if estimate < ACTIVATION else math.ceil(round(estimate, 9))
    target = min(max(raw, floor), ceiling)
    reason = (
        f"adaptive: ceil({rate:.3g} jobs/min x {ready:.3g} s to ready x safety "
        f"{policy.safety:.3g}) = {raw} (estimate {estimate:.3g}, below {ACTIVATION} counts as 0), "
        f"clamped to [minIdle {floor} ({where}), maxIdle {ceiling}] = {target}"
    )
    return WarmPoolDecision(
        target=target,
        state=new_state,
        floor=floor,
        ceiling=ceiling,
        active_schedule=window.name if window else None,
        estimate=estimate,
        reason=reason,
    )
