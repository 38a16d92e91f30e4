"""The pool's status as a pass concludes it: a typed patch of the fields this controller owns
(:class:`~impvm.api.models.ImpVMRunnerPoolStatus`, serialised once by
:func:`impvm.api.patches.wire`) and whether writing it would change anything. Pure.

``lastPoll``, ``rateLimit`` and ``timings`` change with every pass: they are written along
with a real change (and ``lastPoll`` whenever the pass polled); ``warmPool`` is compared as a
value (the API server may spell a time differently)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from impvm.api.conditions import ConditionSet
from impvm.api.models import (
    ImpVMRunnerPoolStatus,
    PollStatus,
    PoolTimings,
    RateLimitStatus,
    WarmPoolStatus,
)
from impvm.api.patches import whole_seconds, wire
from impvm.scaling import timings
from impvm.scaling.poolpass.acts import ActsDone, PoolActs
from impvm.scaling.poolpass.sizing import Counts
from impvm.scaling.poolpass.warm import warm_status
from impvm.scaling.poolpass.world import PoolWorld

__all__ = ["needs_write", "pool_status"]

_EVERY_PASS = ("lastPoll", "rateLimit", "timings")


def pool_status(
    world: PoolWorld, acts: PoolActs, done: ActsDone, counts: Counts, window: timings.TimingWindow
) -> ImpVMRunnerPoolStatus:
    """The status fields of a pass that decided acts: counts (with the VMs it created), the
    warm pool, the last scale-up, the job timings of the last hour (``window``; a kind gone
    from it is nulled: a merge patch keeps what it does not name), the rate limit and the
    poll this pass made."""
    status = ImpVMRunnerPoolStatus(
        observed_generation=world.pool.generation,
        starting=counts.starting,
        idle=counts.idle,
        busy=counts.busy,
        total=counts.total,
        desired=counts.desired,
        pending_jobs=counts.pending,
        outdated=counts.outdated,
    )
    if acts.warm is not None:
        status.warm_pool = warm_status(acts.warm[0])
    if done.created:
        status.last_scale_up_time = whole_seconds(world.now)
    summary: dict[str, Any] = dict(timings.summary(window))
    stored = world.pool.stored_status.get("timings") or {}
    status.timings = PoolTimings.model_validate({k: None for k in stored} | summary)
    if (b := world.github.budget) is not None:
        status.rate_limit = RateLimitStatus(
            limit=b.limit,
            remaining=b.remaining,
            reset_at=dt.datetime.fromtimestamp(b.reset, dt.UTC),
            installation=b.installation or None,
        )
    if (p := world.polled) is not None:
        if p.failure is not None:
            text = f"{p.failure.kind.value}: {p.failure.message}"[:500]
            status.last_poll = PollStatus(time=whole_seconds(p.time), error=text)
        else:
            status.last_poll = PollStatus(
                time=whole_seconds(p.time), queued_jobs=p.queued, api_calls=p.api_calls
            )
    return status


def _differs(stored: Mapping[str, Any], key: str, value: Any) -> bool:
    if key == "warmPool":
        have = stored.get(key)
        if have is None:
            return True
        return WarmPoolStatus.model_validate(have) != WarmPoolStatus.model_validate(value)
    return bool(stored.get(key) != value)


def needs_write(world: PoolWorld, status: ImpVMRunnerPoolStatus, conds: ConditionSet) -> bool:
    """Whether writing ``status`` and ``conds`` changes what is stored (see the module
    docstring)."""
    stored = world.pool.stored_status
    body = wire(status)
    stored_conds = list(stored.get("conditions") or [])
    return (
        any(_differs(stored, k, v) for k, v in body.items() if k not in _EVERY_PASS)
        or ("timings" in body and body["timings"] != stored.get("timings"))
        or conds.merged_into(stored_conds) != stored_conds
        or "lastPoll" in body
    )
