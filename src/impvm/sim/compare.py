"""One comparison: a setup (model, pool limits, policy parameters), the policies it builds, and
their runs over one trace (what ``impvm simulate run`` does, without the command line)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from impvm.api.models import ScalingSpec, WarmPoolSpec
from impvm.scaling.labels import job_matches
from impvm.scaling.poolpass import PoolLimits
from impvm.scaling.warmpool import WarmPoolPolicy
from impvm.sim.engine import RunResult, simulate
from impvm.sim.model import Distribution, Model
from impvm.sim.policies import ArcPolicy, DeciderPolicy, GarmPolicy, ImpPolicy
from impvm.sim.report import Summary, plot, summarise, table
from impvm.sim.trace import TraceJob
from impvm.sim.world import Policy

__all__ = [
    "Setup",
    "arrivals",
    "describe",
    "document",
    "make_policy",
    "plot",
    "run_all",
    "summarise",
    "table",
]


#: Command-line option of each adaptive warm-pool field.
_OPTIONS = {
    "maxIdle": "--max-idle",
    "safetyPercent": "--safety-percent",
    "arrivalHalfLifeSeconds": "--arrival-half-life",
    "readyHalfLifeSamples": "--ready-half-life",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """Everything but the trace: the world (``model``), the pool (``labels``, ``limits`` with
    ``limits.min_idle`` the minIdle of fixed, ARC, GARM and Imp) and the adaptive warm pool
    (``warm``, its floor being its own minIdle)."""

    model: Model
    labels: tuple[str, ...]
    limits: PoolLimits
    warm: WarmPoolPolicy
    bin_seconds: float = 600.0
    #: the adaptive pool's ``scaling.warmPool`` and its own minIdle, as a pool spec says them
    warm_pool: WarmPoolSpec | None = None
    adaptive_min_idle: int = 0

    def scaling(self, adaptive: bool) -> ScalingSpec:
        """``spec.scaling`` of the fixed pool (minIdle) or of the adaptive one."""
        lim = self.limits
        return ScalingSpec(
            min_idle=self.adaptive_min_idle if adaptive else lim.min_idle,
            max_concurrent=lim.max_concurrent,
            scale_up_step=lim.scale_up_step,
            cooldown_seconds=lim.cooldown_seconds,
            warm_pool=self.warm_pool if adaptive else None,
        )

    @classmethod
    def build(
        cls,
        *,
        seed: int,
        boot: tuple[float, float],
        assign: tuple[float, float],
        reaction: float,
        labels: tuple[str, ...],
        min_idle: int,
        adaptive_min_idle: int,
        max_idle: int,
        safety_percent: int | None,
        arrival_half_life: int | None,
        ready_half_life: int | None,
        warm_pool: WarmPoolSpec | None,
        max_concurrent: int,
        scale_up_step: int,
        cooldown: int,
        bin_seconds: float,
    ) -> Setup:
        """Check and assemble a setup from command-line values. Raises ValueError with one line
        naming the option or field. The adaptive policy is read through the API model and
        :meth:`WarmPoolPolicy.from_spec`, as the operator reads a pool's."""
        for opt, (median, p95) in (("boot", boot), ("assign", assign)):
            try:
                d = Distribution(median, p95)
            except ValueError as e:
                raise ValueError(f"--{opt}-median/--{opt}-p95: {e}") from None
            if opt == "boot":
                boot_d = d
            else:
                assign_d = d
        if bin_seconds <= 0:
            raise ValueError("--bin-minutes must be > 0")
        checks = (
            ("--min-idle", min_idle >= 0),
            ("--adaptive-min-idle", adaptive_min_idle >= 0),
            ("--max-concurrent", max_concurrent >= 0),
            ("--scale-up-step", scale_up_step >= 1),
            ("--cooldown", cooldown >= 0),
            ("--reaction", reaction >= 0),
        )
        for opt, ok in checks:
            if not ok:
                raise ValueError(f"{opt}: out of range")
        if warm_pool is None:
            raw = {
                "mode": "adaptive",
                "maxIdle": max_idle,
                "safetyPercent": safety_percent,
                "arrivalHalfLifeSeconds": arrival_half_life,
                "readyHalfLifeSamples": ready_half_life,
            }
            try:
                warm_pool = WarmPoolSpec.model_validate(
                    {k: v for k, v in raw.items() if v is not None}
                )
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                opt = _OPTIONS.get(str(err["loc"][0]), str(err["loc"][0]))
                raise ValueError(f"{opt}: {err['msg']}") from None
        try:
            warm = WarmPoolPolicy.from_spec(
                ScalingSpec(min_idle=adaptive_min_idle, warm_pool=warm_pool)
            )
        except ValueError as e:
            raise ValueError(f"adaptive warm pool: {e}") from None
        limits = PoolLimits(
            min_idle=min_idle,
            max_concurrent=max_concurrent,
            scale_up_step=scale_up_step,
            cooldown_seconds=cooldown,
        )
        return cls(
            model=Model(boot=boot_d, assign=assign_d, reaction=reaction, seed=seed),
            labels=labels,
            limits=limits,
            warm=warm,
            bin_seconds=bin_seconds,
            warm_pool=warm_pool,
            adaptive_min_idle=adaptive_min_idle,
        )


def _warm_label(w: WarmPoolPolicy) -> str:
    if w.mode == "fixed":
        base = f"fixed minIdle={w.min_idle}"
    else:
        base = (
            f"adaptive {w.min_idle}..{w.max_idle} safety={w.safety * 100:.0f}% "
            f"half-life={w.arrival_half_life_seconds:g}s"
        )
    if w.schedules:
        base += " schedules=" + ",".join(f"{s.name}:{s.min_idle}" for s in w.schedules)
    return base


def make_policy(name: str, setup: Setup, start: datetime) -> Policy:
    """A fresh policy ``name`` (``fixed``, ``adaptive``, ``arc``, ``garm``, ``imp``) for one run
    starting at ``start``. Raises ValueError for another name."""
    lim = setup.limits
    if name == "fixed":
        fixed = WarmPoolPolicy(min_idle=lim.min_idle, max_idle=lim.min_idle)
        return DeciderPolicy("fixed", _warm_label(fixed), setup.scaling(False), start)
    if name == "adaptive":
        return DeciderPolicy("adaptive", _warm_label(setup.warm), setup.scaling(True), start)
    if name == "arc":
        return ArcPolicy(min_runners=lim.min_idle, max_runners=lim.max_concurrent)
    if name == "garm":
        return GarmPolicy(min_idle=lim.min_idle, max_runners=lim.max_concurrent)
    if name == "imp":
        return ImpPolicy(
            min_idle=lim.min_idle,
            max_concurrent=lim.max_concurrent,
            scale_up_step=lim.scale_up_step,
        )
    raise ValueError(f"unknown policy {name!r}")


def run_all(jobs: Sequence[TraceJob], setup: Setup, names: Sequence[str]) -> list[RunResult]:
    """Run each policy in ``names`` over ``jobs`` (same seed, same trace, same start)."""
    start = jobs[0].queued_at
    return [
        simulate(
            jobs,
            make_policy(n, setup, start),
            setup.model,
            setup.labels,
            start=start,
            bin_seconds=setup.bin_seconds,
        )
        for n in names
    ]


def arrivals(jobs: Sequence[TraceJob], setup: Setup) -> list[float]:
    """Queued times (seconds from the first job) of the jobs the pool serves."""
    t0 = jobs[0].queued_at
    return [(j.queued_at - t0).total_seconds() for j in jobs if job_matches(j.labels, setup.labels)]


def describe(setup: Setup) -> str:
    """One line: the world and the pool the table was made in."""
    m, lim = setup.model, setup.limits
    return (
        f"time-to-ready {m.boot}, GitHub assignment {m.assign}, reaction {m.reaction:g}s; "
        f"pool labels {' '.join(setup.labels)}, maxConcurrent {lim.max_concurrent}, "
        f"scaleUpStep {lim.scale_up_step}, cooldownSeconds {lim.cooldown_seconds}"
    )


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def document(
    path: Path, jobs: Sequence[TraceJob], setup: Setup, summaries: Sequence[Summary]
) -> dict[str, Any]:
    """The JSON of ``impvm simulate -o json``."""
    m, lim, w = setup.model, setup.limits, setup.warm
    return {
        "trace": {
            "path": str(path),
            "jobs": len(jobs),
            "first_queued_at": _iso(jobs[0].queued_at),
            "last_queued_at": _iso(jobs[-1].queued_at),
        },
        "model": {
            "seed": m.seed,
            "boot_seconds": {"median": m.boot.median, "p95": m.boot.p95},
            "assign_seconds": {"median": m.assign.median, "p95": m.assign.p95},
            "reaction_seconds": m.reaction,
        },
        "pool": {
            "labels": list(setup.labels),
            "min_idle": lim.min_idle,
            "max_concurrent": lim.max_concurrent,
            "scale_up_step": lim.scale_up_step,
            "cooldown_seconds": lim.cooldown_seconds,
            "adaptive": {
                "mode": w.mode,
                "min_idle": w.min_idle,
                "max_idle": w.max_idle,
                "safety_percent": round(w.safety * 100),
                "arrival_half_life_seconds": w.arrival_half_life_seconds,
                "ready_half_life_samples": w.ready_half_life_samples,
                "schedules": [s.name for s in w.schedules],
            },
        },
        "policies": [s.wire() for s in summaries],
    }
