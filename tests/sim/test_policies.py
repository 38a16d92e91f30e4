"""Each policy's formula on tiny hand-made traces with hand-computed answers, plus determinism
of the simulator with a seed. The world is constant: a runner is online 10 s after its VM is
created, GitHub starts a job 1 s after pairing it with an idle runner, passes run at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from impvm.api.models import (
    ImpVMSpec,
    ImpVMStatus,
    JobStatus,
    RunnerStatus,
    ScalingSpec,
    VMPhase,
    WarmPoolSchedule,
    WarmPoolSpec,
)
from impvm.api.vm import VM
from impvm.sim.compare import Setup, make_policy, run_all
from impvm.sim.engine import RunResult, simulate
from impvm.sim.model import Distribution, Model
from impvm.sim.policies import ArcPolicy, DeciderPolicy, GarmPolicy, ImpPolicy
from impvm.sim.report import percentile, summarise
from impvm.sim.trace import DayProfile, TraceJob, generate
from impvm.sim.world import TEMPLATE, TRIGGER_ANNOTATION, Actions, Policy, PoolView

T0 = datetime(2026, 3, 2, 0, 0, tzinfo=UTC)
WORLD = Model(boot=Distribution(10, 10), assign=Distribution(1, 1), reaction=0.0, seed=1)
LABELS = ("imp",)


def jobs(*spec: tuple[float, float]) -> list[TraceJob]:
    """Jobs ``(queued seconds after T0, duration seconds)``."""
    return [TraceJob(T0 + timedelta(seconds=q), ("self-hosted", "imp"), d) for q, d in spec]


def scaling(min_idle: int = 0, warm_pool: WarmPoolSpec | None = None, **kw: int) -> ScalingSpec:
    """A pool's ``spec.scaling``: maxConcurrent and scaleUpStep 100, cooldown 0 unless given."""
    base = {"max_concurrent": 100, "scale_up_step": 100, "cooldown_seconds": 0}
    base.update(kw)
    return ScalingSpec(min_idle=min_idle, warm_pool=warm_pool, **base)


def fixed(min_idle: int, **kw: int) -> DeciderPolicy:
    return DeciderPolicy("fixed", "fixed", scaling(min_idle, **kw), T0)


def run(trace: list[TraceJob], policy: Policy) -> RunResult:
    return simulate(trace, policy, WORLD, LABELS, start=T0)


# --------------------------------------------------------------------------------------------
# One warm runner, one job (t=100, 50 s)


def test_fixed_min_idle_keeps_one_warm_and_replaces_it_at_once() -> None:
    # t=0: 1 VM (online 10); t=100: the job pairs with it (starts 101) and the pass sees
    # busy 0 + pending 1 + minIdle 1 = 2 > 1 live: a second VM (online 110); done at 151
    r = run(jobs((100, 50)), fixed(1))
    assert r.waits == [1.0]
    assert r.idle_seconds == pytest.approx((101 - 10) + (151 - 110))
    assert r.vm_seconds == pytest.approx(151 + (151 - 100))
    assert (r.peak_vms, r.vms_created, r.end, r.unserved) == (2, 2, 151.0, 0)


def test_arc_min_runners_plus_assigned_jobs_equals_it_here() -> None:
    # t=0 empty batch: target max(-1, 0 + 1) = 1; t=100: 1 + 1 assigned = 2
    a = run(jobs((100, 50)), ArcPolicy(min_runners=1, max_runners=100))
    f = run(jobs((100, 50)), fixed(1))
    assert (a.waits, a.idle_seconds, a.vm_seconds, a.peak_vms) == (
        f.waits,
        f.idle_seconds,
        f.vm_seconds,
        f.peak_vms,
    )


def test_garm_tops_up_min_idle_on_its_five_second_loop() -> None:
    # consolidation at t=100 still counts the runner being assigned as idle; at t=105 it is
    # busy, so the loop makes the replacement then (online 115)
    r = run(jobs((100, 50)), GarmPolicy(min_idle=1, max_runners=100))
    assert r.waits == [1.0]
    assert r.idle_seconds == pytest.approx((101 - 10) + (151 - 115))
    assert r.vm_seconds == pytest.approx(151 + (151 - 105))


def test_garm_waits_out_the_job_backoff_before_making_a_runner() -> None:
    # no idle runner: the job gets its own runner at age 30 s (t=30), online 40, started 41
    assert run(jobs((0, 50)), GarmPolicy(min_idle=0, max_runners=100)).waits == [41.0]
    assert run(jobs((0, 50)), GarmPolicy(0, 100, backoff_seconds=0)).waits == [11.0]


def test_garm_serves_each_queued_job_after_its_backoff() -> None:
    # A (t=0) and B (t=1): the 5 s loop makes A's runner at t=30 (online 40) and B's at t=35,
    # when B is 34 s old (online 45)
    r = run(jobs((0, 50), (1, 50)), GarmPolicy(min_idle=0, max_runners=100))
    assert r.waits == [41.0, 45.0]


def vm(name: str, *, online: bool = True, busy: bool = False, trigger: int | None = None) -> VM:
    """A simulated VM, created ``name[2:]`` seconds after T0, its runner online or starting,
    running job 7 when busy, made for job ``trigger``."""
    n = int(name[2:])
    status = ImpVMStatus(
        phase=VMPhase.RUNNING if online else VMPhase.STARTING,
        runner=RunnerStatus(id=n, name=name),
        job=JobStatus(id=7, workflow_run_id=7, repository="sim/repo") if busy else None,
    )
    return VM(
        namespace="sim",
        name=name,
        created_at=T0 + timedelta(seconds=n),
        spec=ImpVMSpec(class_ref={"name": "sim"}, image=TEMPLATE.image),  # type: ignore[arg-type]
        status=status,
        annotations={TRIGGER_ANNOTATION: str(trigger)} if trigger is not None else {},
    )


def view(now: float, vms: list[VM], **kw: Any) -> PoolView:
    return PoolView(now=now, clock=T0 + timedelta(seconds=now), vms=tuple(vms), **kw)


def test_garm_breaks_the_lock_of_a_job_whose_runner_took_another() -> None:
    p = GarmPolicy(min_idle=0, max_runners=100)
    p.plan(view(0, [], queued=2, queued_jobs=((1, 0.0), (2, 0.0))))
    a = p.plan(view(30, [], queued=2, queued_jobs=((1, 0.0), (2, 0.0))))
    assert a.create == 2 and a.triggers == (1, 2) and p.locked == {1, 2}
    # the runner made for job 1 started job 2: job 1 is unlocked, its backoff starts again
    took = vm("r-1", busy=True, trigger=1)
    p.plan(view(40, [took], queued=1, queued_jobs=((1, 0.0),), started=((2, "r-1"),)))
    assert p.locked == set() and p.updated[1] == 40
    assert p.plan(view(65, [took], queued=1, queued_jobs=((1, 0.0),))).create == 0
    assert p.plan(view(70, [took], queued=1, queued_jobs=((1, 0.0),))).triggers == (1,)


def test_garm_scales_down_half_the_surplus_each_minute() -> None:
    p = GarmPolicy(min_idle=1, max_runners=100)
    idle = [vm(f"r-{i}") for i in range(1, 8)]  # 7 idle, 1 queued job: surplus 7 - (1 + 1) = 5
    assert p.plan(view(30, idle, queued=1, queued_jobs=((9, 29.0),))).delete == ()
    a = p.plan(view(60, idle, queued=1, queued_jobs=((9, 29.0),)))
    assert a.delete == ("r-1", "r-2", "r-3")  # ceil(5 * 0.5)
    assert p.plan(view(61, idle[3:], queued=1, queued_jobs=((9, 29.0),))).delete == ()


def test_arc_keeps_its_target_on_an_empty_batch_and_drops_it_on_completion() -> None:
    p = ArcPolicy(min_runners=1, max_runners=100)
    busy = [vm(f"r-{i}", busy=True) for i in range(1, 4)]
    assert p.plan(view(0, busy, queued=2)).create == 3  # 1 + 5 assigned - 3 live
    idle = [vm(f"r-{i}") for i in range(1, 7)]
    assert p.plan(view(10, idle, queued=0)).delete == ()  # empty batch: the target stays 6
    a = p.plan(view(20, idle, queued=0, completed=1))
    assert len(a.delete) == 5  # back to minRunners
    starting = vm("r-9", online=False)
    a = p.plan(view(30, [*idle[:2], starting, *busy], queued=0, completed=1))
    assert a.delete == ("r-9", "r-2")  # pending first, then the newest idle; never a busy one


def test_imp_never_scales_down_and_counts_busy_as_capacity() -> None:
    p = ImpPolicy(min_idle=1, max_concurrent=100, scale_up_step=10)
    assert p.plan(view(0, [vm(f"r-{i}") for i in range(1, 6)], queued=0)) == Actions()
    assert p.plan(view(0, [vm("r-1", busy=True)], queued=1)).create == 0
    assert p.plan(view(0, [vm("r-1", busy=True)], queued=3)).create == 2


def test_imp_counts_busy_runners_as_idle() -> None:
    # minIdle 1: A (t=100) takes the warm runner; B (t=102) finds none and Imp sees
    # desired max(1, queued 1) = 1 = active 1 (A's busy VM): nothing is made until A's VM is
    # gone at t=151; B's runner is online at 161 and B starts at 162
    r = run(jobs((100, 50), (102, 50)), ImpPolicy(min_idle=1, max_concurrent=100, scale_up_step=10))
    assert r.waits == [1.0, 60.0]
    f = run(jobs((100, 50), (102, 50)), fixed(1))
    assert f.waits == [1.0, 9.0]  # the replacement made at t=100 is online at 110


def test_cold_start_waits_one_boot_for_every_policy_but_garm() -> None:
    for p in (fixed(0), ArcPolicy(0, 100), ImpPolicy(0, 100, 10)):
        assert run(jobs((0, 50)), p).waits == [11.0], p


def test_scale_up_step_and_max_concurrent_bound_the_decider() -> None:
    burst = jobs(*[(0, 30)] * 5)
    slow = Model(boot=WORLD.boot, assign=WORLD.assign, reaction=1.0, seed=1)
    r = simulate(burst, fixed(0, scale_up_step=2), slow, LABELS, start=T0)
    # each pass makes 2 and its creations wake the next pass a reaction (1 s) later: VMs made
    # at t=0, 0, 1, 1, 2 are online 10 s later and their jobs start 1 s after that
    assert sorted(r.waits) == [11.0, 11.0, 12.0, 12.0, 13.0]
    capped = run(burst, fixed(0, max_concurrent=2))
    # 2 at a time: two start at 11, finish at 41; the pass at 41 deletes them, makes 2 (online
    # 51), then the last one after 51 + 30: made at 82, online 92
    assert sorted(capped.waits) == [11.0, 11.0, 52.0, 52.0, 93.0]
    assert capped.peak_vms == 2


def test_cooldown_keeps_surplus_until_it_elapsed() -> None:
    # adaptive with a schedule window 00:10-00:20 minIdle 2, floor 0: the two runners made at
    # 00:10 (online 00:10:10) idle until the window closes at 00:20; with cooldown 0 they go then
    window = WarmPoolSchedule(name="w", start="10 0 * * *", end="20 0 * * *", min_idle=2)
    warm = WarmPoolSpec(mode="fixed", schedules=[window])
    trace = jobs((0, 5), (1800, 5))
    r = run(trace, DeciderPolicy("w", "w", scaling(0, warm), T0))
    assert r.waits == [11.0, 11.0]
    # made by the first pass at or after 600 s, deleted by the first at or after 1200 s; passes
    # are at most one resync (10 s) apart
    assert 2 * (1200 - 620) <= r.idle_seconds <= 2 * (1210 - 610)
    slow = run(trace, DeciderPolicy("w", "w", scaling(0, warm, cooldown_seconds=900), T0))
    # the surplus is kept until 900 s after the last scale-up
    assert 2 * (1500 - 620) <= slow.idle_seconds <= 2 * (1520 - 610)


def test_adaptive_warms_up_from_demand() -> None:
    # 60 jobs, one every 2 s (30/min), each 100 s; boot 10 s: once the estimate has samples it
    # asks for ceil(rate * 10 s * safety) runners, so later jobs find warm runners
    warm = WarmPoolSpec(mode="adaptive", max_idle=20, arrival_half_life_seconds=60)
    policy = DeciderPolicy("adaptive", "adaptive", scaling(0, warm), T0)
    r = run(jobs(*[(2 * i, 100) for i in range(60)]), policy)
    cold = run(jobs(*[(2 * i, 100) for i in range(60)]), fixed(0))
    assert percentile(cold.waits, 50) == pytest.approx(11.0)
    assert percentile(r.waits, 50) == pytest.approx(1.0)
    assert max(t for _, t in policy.targets) >= 5
    assert policy.state.ready_seconds == pytest.approx(10.0)
    assert 0 < policy.state.ready_samples <= r.vms_created


def test_jobs_of_other_labels_are_ignored() -> None:
    trace = [TraceJob(T0, ("self-hosted", "gpu"), 10), *jobs((5, 10))]
    r = run(trace, fixed(0))
    assert (r.unmatched, len(r.waits)) == (1, 1)


def test_an_unservable_job_is_reported_at_the_horizon() -> None:
    r = simulate(jobs((0, 10)), fixed(0, max_concurrent=0), WORLD, LABELS, start=T0, horizon=60)
    assert (r.unserved, r.waits) == (1, [])
    assert r.censored and r.censored[0] >= 60
    assert summarise(r).p95_wait_seconds >= 60


# --------------------------------------------------------------------------------------------
# Determinism


def _setup(seed: int) -> Setup:
    return Setup.build(
        seed=seed,
        boot=(15, 40),
        assign=(2, 6),
        reaction=0.25,
        labels=LABELS,
        min_idle=2,
        adaptive_min_idle=0,
        max_idle=10,
        safety_percent=None,
        arrival_half_life=None,
        ready_half_life=None,
        warm_pool=None,
        max_concurrent=100,
        scale_up_step=20,
        cooldown=60,
        bin_seconds=600,
    )


def test_same_seed_same_run_other_seed_other_run() -> None:
    profile = DayProfile(peak_per_minute=1.0, burst_size=30, burst_at=10.0)
    trace = [j for j in generate(profile, seed=3) if 7 <= j.queued_at.hour < 11]
    names = ["fixed", "adaptive", "arc", "garm", "imp"]
    a = [summarise(r) for r in run_all(trace, _setup(5), names)]
    b = [summarise(r) for r in run_all(trace, _setup(5), names)]
    c = [summarise(r) for r in run_all(trace, _setup(6), names)]
    assert a == b
    assert [s.p50_wait_seconds for s in a] != [s.p50_wait_seconds for s in c]
    assert [s.policy for s in a] == names


def test_make_policy_names() -> None:
    s = _setup(1)
    assert make_policy("adaptive", s, T0).label.startswith("adaptive 0..10 safety=")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("keda", s, T0)
