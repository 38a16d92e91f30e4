"""The warm pool in the pure pool pass (impvm.scaling.poolpass.warm_pool): the job table's
arrivals and the runners' first time online are folded into status.warmPool exactly once, on a
moving clock; the target is the sizing's minIdle; status.warmPool is written only when it
changed; a bad warmPool spec is a condition."""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.conditions import merge_conditions
from impvm.api.models import ImpVMRunnerPoolStatus
from impvm.api.patches import wire
from impvm.scaling.jobs import Arrival, Job, PoolScope
from impvm.scaling.jobtable import JobTable
from impvm.scaling.labels import PoolLabels
from impvm.scaling.poolpass import PassConclusion, PoolActs, PoolMemory, PoolWorld, WarmPoolMemory
from impvm.scaling.poolpass.warm import READY_RESOLUTION_SECONDS
from impvm.scaling.warmpool import WarmPoolState
from tests.scaling.builders import MONO, NOW, one_pass, pool_obj, reg, vm, world

LN2 = math.log(2.0)


def adaptive(
    *,
    min_idle: int = 0,
    max_idle: int = 10,
    half_life: int = 60,
    status: dict[str, Any] | None = None,
    **warm: Any,
) -> Any:
    spec = {
        "mode": "adaptive",
        "maxIdle": max_idle,
        "arrivalHalfLifeSeconds": half_life,
        **warm,
    }
    return pool_obj(
        status=status, minIdle=min_idle, maxConcurrent=20, scaleUpStep=20, warmPool=spec
    )


def warm_status(**fields: Any) -> dict[str, Any]:
    return {"warmPool": fields}


def at(w: PoolWorld, seconds: float, **kw: Any) -> PoolWorld:
    """``w`` observed ``seconds`` after :data:`NOW` (wall and monotonic clock move together)."""
    return dataclasses.replace(w, now=NOW + timedelta(seconds=seconds), mono=MONO + seconds, **kw)


def arrivals(first: int, n: int, when: datetime) -> tuple[Arrival, ...]:
    return tuple(Arrival(first + i, when) for i in range(n))


Pass = tuple[PoolActs, PassConclusion]


def target(done: Pass) -> int:
    assert done[0].warm is not None
    return done[0].warm[0].target


def written(done: Pass) -> dict[str, Any]:
    out: dict[str, Any] = dict(wire(done[1].status)["warmPool"])
    return out


def remembered(w: PoolWorld, warm: WarmPoolMemory) -> PoolWorld:
    return dataclasses.replace(w, memory=PoolMemory(warm=warm))


def next_pass(w: PoolWorld, done: Pass) -> PoolWorld:
    """The world the next pass reads when nothing but the pool's status and the memory changed:
    the status as stored once the conclusion was written, the memory it left."""
    end = done[1]
    stored = dict(w.pool.stored_status)
    if end.write:
        conds = merge_conditions(stored.get("conditions") or [], end.conditions)
        stored = {**stored, **wire(end.status), "conditions": conds}
    pool = dataclasses.replace(
        w.pool, stored_status=stored, status=ImpVMRunnerPoolStatus.model_validate(stored)
    )
    return dataclasses.replace(w, pool=pool, memory=end.memory)


# --------------------------------------------------------------------------------------------
# By hand


def test_a_burst_raises_the_target_and_a_quiet_spell_brings_it_back_to_min_idle() -> None:
    # a runner came online in 20 s before; 10 jobs arrive at once; half-life 60 s
    pool = adaptive(
        status=warm_status(readySeconds=20.0, readySamples=1, updatedAt=NOW.isoformat())
    )
    w = at(
        world(pool=pool), 1, arrivals=arrivals(1, 10, NOW + timedelta(seconds=1)), arrivals_read=10
    )
    plan = one_pass(w)
    rate = 10 * 60 * LN2 / 60  # jobs/minute: each arrival adds ln 2 / half-life
    assert target(plan) == math.ceil(rate / 60 * 20 * 2.5) == 6
    sizing = plan[0].sizing
    assert sizing is not None and sizing.counts.desired == 6  # no job pending: warm only
    assert plan[0].create == 6
    st = written(plan)
    assert st["target"] == 6 and math.isclose(st["arrivalRatePerMinute"], rate)
    assert plan[0].warm is not None and plan[0].warm[1].cursor == 10

    # the same arrivals seen again (the table keeps them) are not folded twice
    w = next_pass(w, plan)
    again = one_pass(w)
    assert again[0].warm is not None and again[0].warm[0].state == plan[0].warm[0].state
    assert target(again) == 6 and written(again) == written(plan)

    # four half-lives later: rate/16, target ceil(0.36 runners) = 1, written without new events
    later = one_pass(at(w, 241))
    assert target(later) == 1
    st = written(later)
    assert st["target"] == 1 and st["updatedAt"] == written(plan)["updatedAt"]
    resized = [e.reason for e in later[1].events if e.reason == "WarmPoolResized"]
    assert resized == ["WarmPoolResized"]
    # a quiet half hour: nothing is expected, the pool keeps minIdle (0)
    quiet = one_pass(at(next_pass(at(w, 241), later), 1800))
    assert target(quiet) == 0


def test_the_target_is_clamped_to_max_idle_and_never_below_min_idle() -> None:
    pool = adaptive(min_idle=2, max_idle=4, status=warm_status(readySeconds=60.0, readySamples=3))
    w = world(pool=pool, arrivals=arrivals(1, 50, NOW), arrivals_read=50)
    assert target(one_pass(w)) == 4
    assert target(one_pass(world(pool=pool))) == 2  # no demand: minIdle


def test_an_arrival_recorded_after_a_later_pass_still_counts() -> None:
    """A poll stamps its jobs with the time it started; they are recorded when it ends. A pass in
    between folded up to its own clock: the late arrival is folded in just after that."""
    folded = NOW + timedelta(seconds=30)
    pool = adaptive(
        status=warm_status(
            arrivalRatePerMinute=0.0, readySeconds=10.0, updatedAt=folded.isoformat()
        )
    )
    w = at(
        remembered(world(pool=pool), WarmPoolMemory(cursor=6)),
        31,
        arrivals=(Arrival(7, NOW + timedelta(seconds=29)),),
    )
    warm = one_pass(w)[0].warm
    assert warm is not None
    state = warm[0].state
    assert math.isclose(state.arrival_rate_per_minute, LN2 * 2 ** (-1 / 60), rel_tol=1e-6)
    assert state.updated_at == w.now and warm[1].cursor == 7


def test_a_runner_online_for_the_first_time_is_one_time_to_ready_sample() -> None:
    pool = adaptive(
        status=warm_status(readySeconds=30.0, readySamples=4, updatedAt=NOW.isoformat())
    )
    booting = vm("aaaaaa", created=12, runner=(1, False, False))
    w = at(world((booting,), (reg(1, "aaaaaa"),), pool=pool), 0.5)
    plan = one_pass(w)
    warm = plan[0].warm
    assert warm is not None
    state, mem = warm[0].state, warm[1]
    alpha = 1 - 2 ** (-1 / 10)  # readyHalfLifeSamples 10
    assert state.ready_samples == 5
    assert math.isclose(state.ready_seconds or 0, 30 + alpha * (12.5 - 30))
    assert mem.ready == {booting.name}

    # the next pass reads a VM whose record still lags: the memory keeps it from counting again
    lagging = at(next_pass(w, plan), 2.5)
    assert one_pass(lagging)[0].warm[0].state.ready_samples == 5  # type: ignore[index]

    # after an operator restart (no memory) the recorded runner says it was counted already
    online = vm("aaaaaa", created=12, runner=(1, True, False))
    written_pool = next_pass(w, plan).pool
    restarted = at(world((online,), (reg(1, "aaaaaa"),), pool=written_pool), 3)
    assert one_pass(restarted)[0].warm[0].state.ready_samples == 5  # type: ignore[index]


def test_a_runner_ready_within_its_vms_second_is_a_sample_of_one_second() -> None:
    """A VM's creationTimestamp and GitHub's times carry whole seconds, so a runner ready in the
    second its VM was made reads as 0 s: taken as the resolution instead, a burst still raises
    the target (a first sample of 0 kept it at 0 under any burst)."""
    pool = adaptive(half_life=10)
    same_second = vm("aaaaaa", created=0, runner=(1, False, False))
    w = at(world((same_second,), (reg(1, "aaaaaa"),), pool=pool), 0)
    plan = one_pass(w)
    warm = plan[0].warm
    assert warm is not None
    assert warm[0].state.ready_seconds == READY_RESOLUTION_SECONDS
    burst = at(next_pass(w, plan), 1, arrivals=arrivals(1, 8, NOW + timedelta(seconds=1)))
    assert target(one_pass(burst)) >= 2


def test_a_vm_gone_leaves_the_memory() -> None:
    w = world((vm("aaaaaa", runner=(1, True, False)),), (reg(1, "aaaaaa"),), pool=adaptive())
    ready = frozenset({"pool-01234-bbbbbb", "pool-01234-aaaaaa"})
    w = remembered(w, WarmPoolMemory(ready=ready))
    assert one_pass(w)[0].warm[1].ready == {"pool-01234-aaaaaa"}  # type: ignore[index]


def test_a_read_of_the_pool_that_lags_behind_our_write_uses_the_state_written() -> None:
    pool = adaptive(
        status=warm_status(readySeconds=20.0, readySamples=1, updatedAt=NOW.isoformat())
    )
    w = world(pool=pool, arrivals=arrivals(1, 10, NOW + timedelta(seconds=1)), arrivals_read=10)
    warm = one_pass(at(w, 1))[0].warm
    assert warm is not None
    # next pass: the pool as read still has the old status.warmPool
    stale = at(remembered(w, warm[1]), 2, arrivals=arrivals(1, 11, NOW + timedelta(seconds=2)))
    nxt = one_pass(stale)[0].warm
    assert nxt is not None
    bump = 60 * LN2 / 60
    n = nxt[0].state.arrival_rate_per_minute / bump
    assert 10.8 < n < 11.0  # eleven arrivals, a second or two of decay


def test_fixed_mode_keeps_min_idle_and_schedules_replace_it_on_the_clock() -> None:
    window = {
        "name": "office",
        "start": "0 8 * * 1-5",
        "end": "0 18 * * 1-5",
        "timeZone": "Europe/Berlin",
        "minIdle": 3,
    }
    pool = pool_obj(minIdle=1, warmPool={"mode": "fixed", "schedules": [window]})
    # NOW is Sunday 2026-03-01 12:00 UTC; Monday 07:00 UTC is 08:00 in Berlin (winter time)
    monday = (datetime(2026, 3, 2, 6, 59, 59, tzinfo=NOW.tzinfo) - NOW).total_seconds()
    w = at(world(pool=pool), monday)
    before = one_pass(w)
    assert target(before) == 1 and written(before)["activeSchedule"] is None
    w = next_pass(w, before)
    opened = one_pass(at(w, monday + 1))
    assert target(opened) == 3 and written(opened)["activeSchedule"] == "office"
    sizing = opened[0].sizing
    assert sizing is not None and sizing.counts.desired == 3
    w = next_pass(at(w, monday + 1), opened)
    closes = monday + 1 + 10 * 3600
    closed = one_pass(at(w, closes))
    assert target(closed) == 1
    assert written(closed)["activeSchedule"] is None  # sent as null: a merge patch removes it


def test_fixed_mode_still_learns_the_estimates() -> None:
    w = world(pool=pool_obj(minIdle=1), arrivals=arrivals(1, 3, NOW), arrivals_read=3)
    plan = one_pass(w)
    assert target(plan) == 1
    assert written(plan)["arrivalRatePerMinute"] > 0


def test_a_bad_warm_pool_spec_is_a_condition_and_changes_nothing() -> None:
    bad = {"name": "w", "start": "0 8 * * *", "end": "0 9 * * *", "timeZone": "Mars/Olympus"}
    pool = pool_obj(warmPool={"mode": "fixed", "schedules": [{**bad, "minIdle": 2}]})
    acts, end = one_pass(world((vm("aaaaaa", phase="Failed"),), pool=pool))
    assert acts.count == 0 and acts.warm is None
    ready = {c["type"]: c for c in end.conditions}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.scaling.warmPool.schedules[0].timeZone" in str(ready["message"])
    assert "warmPool" not in wire(end.status)


def test_status_warm_pool_is_compared_as_a_value() -> None:
    """The API server may spell updatedAt differently (Z or +00:00): no write for that."""
    w = world(pool=adaptive(), arrivals=arrivals(1, 2, NOW), arrivals_read=2)
    w = next_pass(w, one_pass(w))
    spelled = dict(w.pool.stored_status)
    assert spelled["warmPool"]["updatedAt"] != NOW.isoformat()
    spelled["warmPool"] = {**spelled["warmPool"], "updatedAt": NOW.isoformat()}
    spelled["warmPool"].pop("activeSchedule")
    w = dataclasses.replace(w, pool=dataclasses.replace(w.pool, stored_status=spelled))
    assert not one_pass(w)[1].write


# --------------------------------------------------------------------------------------------
# Properties


@st.composite
def pass_runs(draw: st.DrawFn) -> list[tuple[int, list[float], str, float]]:
    """Passes, each: new arrivals, their stamps (seconds relative to the pass's clock; negative:
    recorded late), what happened to the write (ok, crashed before it, or a read that lags)
    and the seconds to the next pass."""
    n = draw(st.integers(1, 12))
    out = []
    for _ in range(n):
        k = draw(st.integers(0, 6))
        stamps = draw(st.lists(st.floats(-20, 0.5), min_size=k, max_size=k))
        out.append(
            (k, stamps, draw(st.sampled_from(["ok", "crash", "lag"])), draw(st.floats(0, 30)))
        )
    return out


@settings(max_examples=150, deadline=None)
@given(pass_runs())
def test_every_arrival_is_folded_in_exactly_once(
    runs: list[tuple[int, list[float], str, float]],
) -> None:
    """Whatever the batching, late stamps, crashed passes (nothing kept) and lagging reads of the
    pool (only the memory has the last write), the arrival-rate EWMA counts each job once:
    with a day's half-life over minutes, rate / (ln 2 / half-life) is the number of jobs."""
    day = 86400
    pool = adaptive(half_life=day)
    stored = dict(pool.stored_status)
    memory = WarmPoolMemory()
    log: list[Arrival] = []
    clock = 0.0
    last: WarmPoolState | None = None
    for k, stamps, fate, gap in runs:
        now = NOW + timedelta(seconds=clock)
        log += [Arrival(len(log) + 1, now + timedelta(seconds=s)) for s in stamps[:k]]
        w = at(
            remembered(world(pool=pool), memory),
            clock,
            arrivals=tuple(a for a in log if a.seq > memory.cursor),
            arrivals_read=len(log),
        )
        w = dataclasses.replace(
            w,
            pool=dataclasses.replace(
                pool, stored_status=stored, status=type(pool.status).model_validate(stored)
            ),
        )
        acts, end = one_pass(w)
        assert acts.warm is not None
        if fate != "crash":
            memory = end.memory.warm
            last = acts.warm[0].state
            if fate == "ok" and end.write:
                stored = {**stored, "warmPool": wire(end.status)["warmPool"]}
        clock += gap
    folded = sum(1 for a in log if a.seq <= memory.cursor)
    rate = last.arrival_rate_per_minute if last is not None else 0.0
    jobs = rate / (60 * LN2 / day)
    assert math.isclose(jobs, folded, rel_tol=0.01, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 5),
    st.integers(0, 10),
    st.lists(st.floats(0, 600), max_size=30),
    st.floats(0, 3600),
)
def test_the_sizing_keeps_the_warm_target_within_min_and_max_idle(
    min_idle: int, extra: int, stamps: list[float], later: float
) -> None:
    pool = adaptive(
        min_idle=min_idle,
        max_idle=min_idle + extra,
        status=warm_status(readySeconds=30.0, readySamples=2),
    )
    log = tuple(Arrival(i + 1, NOW + timedelta(seconds=s)) for i, s in enumerate(sorted(stamps)))
    w = at(world(pool=pool, arrivals=log, arrivals_read=len(log)), 600 + later)
    plan = one_pass(w)
    t = target(plan)
    assert min_idle <= t <= min_idle + extra
    sizing = plan[0].sizing
    assert sizing is not None and sizing.counts.desired == min(20, t)


# --------------------------------------------------------------------------------------------
# The job table's arrivals


SMALL = PoolScope(PoolLabels(namespace="ns", name="small", labels=("imp",)), org="o")
BIG = PoolScope(PoolLabels(namespace="ns", name="big", labels=("imp", "big")), org="o")


def job(i: int, status: str = "queued", labels: tuple[str, ...] = ("imp",), t: float = 0) -> Job:
    return Job(
        id=i,
        run_id=1,
        repository="o/app",
        labels=labels,
        status=status,
        seen_at=NOW + timedelta(seconds=t),
        runner_name="r" if status == "in_progress" else None,
    )


def test_arrivals_are_jobs_first_recorded_queued_numbered_and_routed() -> None:
    table = JobTable(max_remembered=3)
    pools = [SMALL, BIG]
    table.apply(job(1, t=1))
    table.apply(job(1, t=2))  # seen again: no arrival
    table.apply(job(1, "in_progress", t=3))  # moved on: no arrival
    table.apply(job(2, "in_progress", t=4))  # first seen running: none
    table.apply(job(3, labels=("imp", "big"), t=5))
    table.apply(job(4, t=6))
    assert table.last_arrival == 3
    assert table.arrivals(SMALL.key, pools, 0) == [
        Arrival(1, NOW + timedelta(seconds=1)),
        Arrival(3, NOW + timedelta(seconds=6)),
    ]
    assert table.arrivals(BIG.key, pools, 0) == [Arrival(2, NOW + timedelta(seconds=5))]
    assert table.arrivals(SMALL.key, pools, 1) == [Arrival(3, NOW + timedelta(seconds=6))]
    table.apply(job(4, "completed", t=7))  # completed: still an arrival that happened
    assert table.arrivals(SMALL.key, pools, 2) == [Arrival(3, NOW + timedelta(seconds=6))]
    for i in range(5, 9):
        table.apply(job(i, t=i))
    assert [a.seq for a in table.arrivals(SMALL.key, pools, 0)] == [5, 6, 7]  # the last 3 kept
