"""The warm pool of one pass: the events it folds into ``status.warmPool`` and the target that is
the sizing's ``minIdle`` (:mod:`impvm.scaling.warmpool` holds the rules). Pure.

Events, each stamped after ``state.updated_at`` so it is folded in exactly once:

- a :class:`~impvm.scaling.warmpool.JobQueued` per job-table arrival routed to the pool
  numbered above the memory's cursor, at its observation time (an arrival recorded after a
  later pass, as a poll's jobs are, at the instant after ``updated_at``);
- a :class:`~impvm.scaling.warmpool.RunnerReady` per VM whose runner is ready for the first
  time: GitHub lists it online (or busy), or a job record names it as the runner of a job that
  started (a short job's runner may finish between two runner lists; the job's start is then
  its readiness); its recorded runner never was and the memory has not counted it;
  ``seconds`` from the VM's creation to its readiness (at least
  :data:`READY_RESOLUTION_SECONDS`, the timestamps' resolution), stamped ``now``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from impvm.api.models import ScalingSpec, WarmPoolStatus
from impvm.scaling.poolpass.memory import WarmPoolMemory
from impvm.scaling.poolpass.records import ready_at
from impvm.scaling.poolpass.world import PoolWorld
from impvm.scaling.warmpool import (
    JobQueued,
    RunnerReady,
    WarmPoolDecision,
    WarmPoolEvent,
    WarmPoolPolicy,
    WarmPoolState,
    warm_pool_target,
)

__all__ = ["READY_RESOLUTION_SECONDS", "warm_policy", "warm_pool", "warm_status"]

_TICK = dt.timedelta(microseconds=1)
#: The resolution of a time-to-ready sample (seconds): a VM's ``creationTimestamp`` and GitHub's
#: ``started_at`` both carry whole seconds (RFC 3339 without fractions), so a runner ready within
#: the second its VM was made reads as 0 s. A sample is taken as at least this: a first sample of
#: 0 would make the pool look instant and keep its warm target at 0 under any burst.
READY_RESOLUTION_SECONDS = 1.0


def warm_policy(scaling: ScalingSpec | None) -> WarmPoolPolicy:
    """:meth:`WarmPoolPolicy.from_spec` of ``spec.scaling``. Raises ValueError naming the
    field (``spec.scaling`` itself when it is missing)."""
    if scaling is None:
        raise ValueError("spec.scaling is required")
    return WarmPoolPolicy.from_spec(scaling)


def _warm_state(world: PoolWorld) -> WarmPoolState:
    """The newer of ``status.warmPool`` and what the last pass wrote (a read of the pool can
    lag behind our own write)."""
    stored = WarmPoolState.from_status(world.pool.status.warm_pool)
    kept = world.memory.warm.state
    if kept is None or kept.updated_at is None:
        return stored
    if stored.updated_at is None or kept.updated_at > stored.updated_at:
        return kept
    return stored


def warm_pool(world: PoolWorld, policy: WarmPoolPolicy) -> tuple[WarmPoolDecision, WarmPoolMemory]:
    """The warm pool of this pass: its decision (target, new state) and the memory to keep
    (see the module docstring for the events)."""
    state = _warm_state(world)
    since, now = state.updated_at, world.now

    def after(t: dt.datetime) -> dt.datetime:
        return t if since is None or t > since else since + _TICK

    mem = world.memory.warm
    events: list[WarmPoolEvent] = [
        JobQueued(after(a.at)) for a in world.arrivals if a.seq > mem.cursor
    ]
    cursor = max([mem.cursor, world.arrivals_read, *(a.seq for a in world.arrivals)])
    names = {vm.name for vm in world.vms}
    ready = set(mem.ready & names)
    by_name = {r.name: r for r in world.github.runners or ()}
    for vm in sorted(world.vms, key=lambda v: v.name):
        reg, job = by_name.get(vm.name), world.job_on(vm.name)
        up = reg is not None and (reg.online or reg.busy)
        if vm.name in ready or not (up or (job is not None and job.started_at)):
            continue
        ready.add(vm.name)
        at = ready_at(vm, reg, job, now)
        if at is None:
            continue  # counted before (by an earlier operator run)
        seconds = max(READY_RESOLUTION_SECONDS, (at - vm.created_at).total_seconds())
        events.append(RunnerReady(after(now), seconds))
    decision = warm_pool_target(policy, state, events, now)
    return decision, WarmPoolMemory(cursor=cursor, state=decision.state, ready=frozenset(ready))


def warm_status(decision: WarmPoolDecision) -> WarmPoolStatus:
    """``status.warmPool`` as written: every field set, an unset one as null (a merge patch
    removes it)."""
    wire: dict[str, Any] = decision.status().wire()
    wire.setdefault("activeSchedule", None)
    return WarmPoolStatus.model_validate(wire)
