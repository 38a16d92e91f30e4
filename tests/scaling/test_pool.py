"""Unit tests of the pool sizing (impvm.scaling.poolpass.size_pool): every sizing rule, then
properties over arbitrary facts. That a sizing's acts leave nothing for the next pass to do is
tested with the real executor (tests/operator/test_pool_fixpoint.py)."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.api.models import (
    TEMPLATE_HASH_ANNOTATION,
    ImpVMRunnerPoolSpec,
    ImpVMSpec,
    ImpVMStatus,
    JobStatus,
    RunnerStatus,
)
from impvm.api.vm import VM
from impvm.scaling.poolpass import (
    PoolLimits,
    Reason,
    RunnerView,
    Sizing,
    SizingFacts,
    VMState,
    classify,
    parse_demand,
)
from impvm.scaling.poolpass import size_pool as decide

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def limits(**kw: int) -> PoolLimits:
    base = {
        "min_idle": 0,
        "max_concurrent": 10,
        "scale_up_step": 10,
        "cooldown_seconds": 60,
        "bootstrap_timeout_seconds": 300,
    }
    base.update(kw)
    return PoolLimits(**base)


SPEC = {"classRef": {"name": "c"}, "image": "registry.example/i@sha256:" + "1" * 64}


def vm(
    name: str,
    *,
    created_at: datetime | None = None,
    phase: str | None = "Running",
    started_at: datetime | None = None,
    deleting: bool = False,
    runner_id: int | None = None,
    has_secret: bool = True,
    job_id: int | None = None,
    runner_online: bool | None = None,
    runner_busy: bool | None = None,
    outdated: bool = False,
) -> VM:
    """A VM as sizing reads it: phase and times, its recorded runner (id, online, busy) and
    job, whether its JIT Secret exists, and whether it was made from an older template."""
    spec = dict(SPEC)
    if has_secret:
        spec["runnerConfigSecret"] = f"{name}-jit"
    recorded = (runner_id, runner_online, runner_busy) != (None, None, None)
    runner = (
        RunnerStatus(id=runner_id, online=runner_online, busy=runner_busy) if recorded else None
    )
    status = ImpVMStatus(
        phase=phase,  # type: ignore[arg-type]
        started_at=started_at,
        runner=runner,
        job=JobStatus(id=job_id) if job_id is not None else None,
    )
    return VM(
        namespace="ns",
        name=name,
        created_at=ago(10) if created_at is None else created_at,
        spec=ImpVMSpec.model_validate(spec),
        status=status,
        deleting=deleting,
        annotations={TEMPLATE_HASH_ANNOTATION: "old" if outdated else "current"},
    )


def reg(id: int, name: str, *, online: bool = True, busy: bool = False) -> RunnerView:
    return RunnerView(id=id, name=name, online=online, busy=busy)


def idle_vm(name: str, rid: int, **kw: object) -> tuple[VM, RunnerView]:
    return vm(name, runner_id=rid, **kw), reg(rid, name)


def snap(
    lim: PoolLimits | None = None,
    vms: tuple[VM, ...] = (),
    runners: tuple[RunnerView, ...] | None = (),
    **kw: object,
) -> SizingFacts:
    return SizingFacts(
        limits=lim or limits(),
        now=NOW,
        vms=vms,
        runners=runners,
        secrets=frozenset(v.spec.runner_config_secret or "" for v in vms),
        outdated=frozenset(
            v.name for v in vms if v.annotations.get(TEMPLATE_HASH_ANNOTATION) == "old"
        ),
        **kw,  # type: ignore[arg-type]
    )


def deleted(plan: Sizing) -> dict[str, Reason]:
    return {d.name: d.reason for d in plan.delete_vms}


# --------------------------------------------------------------------------------------------
# Classification


@pytest.mark.parametrize(
    ("view", "registration", "state"),
    [
        (vm("a", deleting=True, job_id=1), reg(1, "a", busy=True), VMState.TERMINATING),
        (vm("a", phase="Terminating"), reg(1, "a"), VMState.TERMINATING),
        (vm("a", phase="Succeeded"), None, VMState.TERMINATING),
        (vm("a", phase="Failed"), None, VMState.TERMINATING),
        (vm("a", job_id=7), None, VMState.BUSY),
        (vm("a"), reg(1, "a", busy=True), VMState.BUSY),
        (vm("a"), reg(1, "a", online=True), VMState.IDLE),
        (vm("a"), reg(1, "a", online=False), VMState.STARTING),
        (vm("a", phase="Pending"), None, VMState.STARTING),
        (vm("a", phase=None), None, VMState.STARTING),
    ],
)
def test_classify(view: VM, registration: RunnerView | None, state: VMState) -> None:
    assert classify(view, registration) is state


def test_registration_matched_by_recorded_id_else_by_name() -> None:
    # By id: the registration's name does not matter.
    plan = decide(snap(vms=(vm("a", runner_id=5),), runners=(reg(5, "other"),)))
    assert (plan.counts.idle, plan.counts.starting) == (1, 0)
    # No id recorded: matched by name (runner name = VM name).
    plan = decide(snap(vms=(vm("a"),), runners=(reg(5, "a"),)))
    assert (plan.counts.idle, plan.counts.starting) == (1, 0)
    # An id recorded but absent: a same-named registration with another id is not its runner.
    plan = decide(snap(vms=(vm("a", runner_id=5, phase="Pending"),), runners=(reg(6, "a"),)))
    assert (plan.counts.idle, plan.counts.starting) == (0, 1)


# --------------------------------------------------------------------------------------------
# Terminal VMs


def test_terminal_vms_are_deleted_with_their_phase_as_reason() -> None:
    plan = decide(snap(vms=(vm("ok", phase="Succeeded", runner_id=1), vm("bad", phase="Failed"))))
    assert deleted(plan) == {"ok": Reason.SUCCEEDED, "bad": Reason.FAILED}
    assert all(not d.deregister_first for d in plan.delete_vms)
    assert plan.delete_vms[0].runner_id == 1 or plan.delete_vms[1].runner_id == 1
    assert plan.counts.terminating == 2


def test_terminal_vm_already_deleting_is_not_deleted_again() -> None:
    plan = decide(snap(vms=(vm("ok", phase="Succeeded", deleting=True),)))
    assert plan.delete_vms == ()


def test_terminal_vms_hold_capacity_until_their_deletion_completes() -> None:
    vms = tuple(vm(f"t{i}", phase="Succeeded") for i in range(3))
    plan = decide(snap(limits(min_idle=2, max_concurrent=3), vms))
    assert len(plan.delete_vms) == 3
    assert plan.counts.desired == 2
    assert plan.create == 0
    assert "headroom 0" in plan.create_reason


def test_terminal_deletions_happen_even_when_github_is_unknown() -> None:
    plan = decide(snap(vms=(vm("ok", phase="Succeeded"),), runners=None))
    assert deleted(plan) == {"ok": Reason.SUCCEEDED}


# --------------------------------------------------------------------------------------------
# Desired count and creation


def test_empty_pool_creates_min_idle() -> None:
    plan = decide(snap(limits(min_idle=2)))
    assert plan.create == 2
    assert plan.scaled_up
    assert plan.counts.desired == 2
    assert "desired 2" in plan.create_reason


def test_busy_runners_do_not_count_as_idle() -> None:
    vms = (vm("b1", job_id=1), vm("b2", runner_id=2))
    plan = decide(snap(limits(min_idle=1), vms, runners=(reg(2, "b2", busy=True),)))
    assert plan.counts.busy == 2
    assert plan.counts.desired == 3
    assert plan.create == 1


def test_starting_vms_count_towards_min_idle() -> None:
    plan = decide(snap(limits(min_idle=2), (vm("s1", phase="Pending"), vm("s2"))))
    assert plan.counts.starting == 2
    assert plan.create == 0
    assert not plan.scaled_up


def test_idle_vms_satisfy_min_idle() -> None:
    a, ra = idle_vm("a", 1)
    plan = decide(snap(limits(min_idle=1), (a,), (ra,)))
    assert plan.counts.idle == 1
    assert plan.create == 0
    assert plan.delete_vms == ()
    assert "nothing to create" in plan.create_reason


@pytest.mark.parametrize(
    ("queued", "annotation", "pending"),
    [(0, None, 0), (3, None, 3), (0, 4, 4), (3, 5, 5), (6, 2, 6), (2, 0, 2)],
)
def test_pending_is_max_of_queued_jobs_and_annotation(
    queued: int, annotation: int | None, pending: int
) -> None:
    plan = decide(snap(limits(min_idle=1), queued_jobs=queued, demand_annotation=annotation))
    assert plan.counts.pending == pending
    assert plan.counts.desired == pending + 1
    assert plan.create == pending + 1


def test_desired_is_capped_by_max_concurrent() -> None:
    plan = decide(snap(limits(min_idle=2, max_concurrent=4), queued_jobs=10))
    assert plan.counts.desired == 4
    assert plan.create == 4


def test_creation_is_capped_by_scale_up_step() -> None:
    plan = decide(snap(limits(min_idle=5, scale_up_step=2)))
    assert plan.create == 2
    assert "scaleUpStep 2" in plan.create_reason


def test_deleting_and_terminating_vms_count_towards_max_concurrent() -> None:
    vms = (vm("d", deleting=True), vm("t", phase="Terminating"))
    plan = decide(snap(limits(min_idle=3, max_concurrent=4), vms))
    assert plan.counts.terminating == 2
    assert plan.counts.total == 2
    assert plan.create == 2


def test_max_concurrent_zero_creates_nothing() -> None:
    plan = decide(snap(limits(min_idle=0, max_concurrent=0), queued_jobs=3))
    assert plan.counts.desired == 0
    assert plan.create == 0


def test_no_creation_while_github_inventory_is_unknown() -> None:
    plan = decide(snap(limits(min_idle=2), runners=None))
    assert plan.create == 0
    assert plan.counts.desired == 2
    assert "unknown" in plan.create_reason


# --------------------------------------------------------------------------------------------
# Scale-down


def _three_idle() -> tuple[tuple[VM, ...], tuple[RunnerView, ...]]:
    pairs = [idle_vm(f"i{i}", i, created_at=ago(100 - i)) for i in range(3)]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def test_surplus_idle_removed_once_cooldown_elapsed() -> None:
    vms, runners = _three_idle()
    plan = decide(
        snap(limits(min_idle=1, cooldown_seconds=60), vms, runners, last_scale_up_time=ago(61))
    )
    assert [d.name for d in plan.delete_vms] == ["i2", "i1"]  # newest first
    assert all(d.reason is Reason.SURPLUS and d.deregister_first for d in plan.delete_vms)
    assert [d.runner_id for d in plan.delete_vms] == [2, 1]
    assert plan.create == 0


def test_surplus_kept_during_cooldown() -> None:
    vms, runners = _three_idle()
    plan = decide(
        snap(limits(min_idle=1, cooldown_seconds=60), vms, runners, last_scale_up_time=ago(59))
    )
    assert plan.delete_vms == ()
    assert any("cooldown 60s" in n for n in plan.notes)


def test_cooldown_boundary_exactly_elapsed_removes() -> None:
    vms, runners = _three_idle()
    plan = decide(
        snap(limits(min_idle=2, cooldown_seconds=60), vms, runners, last_scale_up_time=ago(60))
    )
    assert [d.name for d in plan.delete_vms] == ["i2"]


def test_no_scale_up_recorded_means_cooldown_elapsed() -> None:
    vms, runners = _three_idle()
    plan = decide(snap(limits(min_idle=2, cooldown_seconds=86400), vms, runners))
    assert [d.name for d in plan.delete_vms] == ["i2"]


def test_surplus_prefers_starting_vms_then_newest_idle() -> None:
    a, ra = idle_vm("a", 1, created_at=ago(5))
    b, rb = idle_vm("b", 2, created_at=ago(50))
    s_old = vm("s-old", phase="Pending", created_at=ago(40))
    s_new = vm("s-new", phase="Pending", created_at=ago(20), runner_id=9)
    plan = decide(
        snap(limits(min_idle=1), (a, b, s_old, s_new), (ra, rb, reg(9, "s-new", online=False)))
    )
    assert [d.name for d in plan.delete_vms] == ["s-new", "s-old", "a"]
    by_name = {d.name: d for d in plan.delete_vms}
    assert by_name["s-new"].deregister_first and by_name["s-new"].runner_id == 9
    assert not by_name["s-old"].deregister_first and by_name["s-old"].runner_id is None


def test_surplus_ties_broken_by_name() -> None:
    vms = tuple(vm(n, phase="Pending", created_at=ago(5)) for n in ("b", "a", "c"))
    plan = decide(snap(limits(min_idle=1), vms))
    assert [d.name for d in plan.delete_vms] == ["c", "b"]


def test_scale_down_never_deletes_busy_runners() -> None:
    busy = (vm("b1", job_id=1), vm("b2", runner_id=2))
    a, ra = idle_vm("a", 3)
    # maxConcurrent lowered below the busy count: desired 1 < busy 2.
    plan = decide(
        snap(limits(min_idle=0, max_concurrent=1), (*busy, a), (reg(2, "b2", busy=True), ra))
    )
    assert plan.counts.desired == 1
    assert [d.name for d in plan.delete_vms] == ["a"]
    assert any("busy" in n and "never scaled down" in n for n in plan.notes)


def test_scale_to_zero_when_min_idle_zero_and_no_demand() -> None:
    a, ra = idle_vm("a", 1)
    s = vm("s", phase="Starting")
    b = vm("b", job_id=4)
    plan = decide(snap(limits(min_idle=0), (a, s, b), (ra,), demand_annotation=0))
    assert deleted(plan) == {"a": Reason.SURPLUS, "s": Reason.SURPLUS}
    assert plan.counts.desired == 1


def test_surplus_kept_when_github_inventory_unknown() -> None:
    plan = decide(snap(limits(min_idle=0), (vm("s", phase="Pending"),), runners=None))
    assert plan.delete_vms == ()
    assert any("unknown" in n for n in plan.notes)


# --------------------------------------------------------------------------------------------
# Bootstrap timeout


def test_vm_not_online_within_bootstrap_timeout_is_deleted_and_replaced() -> None:
    late = vm("late", phase="Running", created_at=ago(301), runner_id=7)
    plan = decide(snap(limits(min_idle=1), (late,), (reg(7, "late", online=False),)))
    (d,) = plan.delete_vms
    assert d.reason is Reason.BOOTSTRAP_TIMEOUT
    assert d.deregister_first and d.runner_id == 7
    assert "300s" in d.message
    assert plan.create == 1  # replacement; capacity still counted for the late VM


def test_bootstrap_timeout_replacement_respects_max_concurrent() -> None:
    late = vm("late", phase="Pending", created_at=ago(1000))
    plan = decide(snap(limits(min_idle=1, max_concurrent=1), (late,)))
    assert deleted(plan) == {"late": Reason.BOOTSTRAP_TIMEOUT}
    assert not plan.delete_vms[0].deregister_first
    assert plan.create == 0


def test_bootstrap_timeout_boundary_is_exclusive() -> None:
    plan = decide(snap(limits(min_idle=1), (vm("v", phase="Pending", created_at=ago(300)),)))
    assert plan.delete_vms == ()


def test_bootstrap_timeout_counts_from_start_when_started() -> None:
    v = vm("v", phase="Starting", created_at=ago(1000), started_at=ago(100))
    assert decide(snap(limits(min_idle=1), (v,))).delete_vms == ()
    v = vm("v", phase="Starting", created_at=ago(1000), started_at=ago(301))
    assert deleted(decide(snap(limits(min_idle=1), (v,)))) == {"v": Reason.BOOTSTRAP_TIMEOUT}


def test_bootstrap_timeout_registration_found_by_name_is_removed() -> None:
    v = vm("v", phase="Pending", created_at=ago(400))
    plan = decide(snap(limits(min_idle=1), (v,), (reg(3, "v", online=False),)))
    (d,) = plan.delete_vms
    assert d.runner_id == 3 and d.deregister_first


def test_old_online_or_busy_vms_are_not_timed_out() -> None:
    a, ra = idle_vm("a", 1, created_at=ago(5000))
    b = vm("b", created_at=ago(5000), job_id=2)
    plan = decide(snap(limits(min_idle=2), (a, b), (ra,)))
    assert plan.delete_vms == ()


def test_no_bootstrap_timeout_when_github_inventory_unknown() -> None:
    plan = decide(snap(limits(min_idle=1), (vm("v", phase="Pending", created_at=ago(1000)),), None))
    assert plan.delete_vms == ()


# --------------------------------------------------------------------------------------------
# Registration vanished


def test_running_vm_whose_registration_vanished_is_replaced() -> None:
    v = vm("v", phase="Running", runner_id=5)
    plan = decide(snap(limits(min_idle=1), (v,), ()))
    (d,) = plan.delete_vms
    assert d.reason is Reason.REGISTRATION_VANISHED
    assert not d.deregister_first and d.runner_id == 5
    assert plan.create == 1


@pytest.mark.parametrize(
    "view",
    [
        vm("v", phase="Pending", runner_id=5),  # still starting
        vm("v", phase="Starting", runner_id=5),
        vm("v", phase="Running", runner_id=5, job_id=9),  # busy: the job ended the registration
        vm("v", phase="Running"),  # no runner id recorded
    ],
)
def test_not_treated_as_vanished(view: VM) -> None:
    plan = decide(snap(limits(min_idle=1), (view,), ()))
    assert plan.delete_vms == ()


def test_vanished_not_judged_without_inventory() -> None:
    plan = decide(snap(limits(min_idle=1), (vm("v", runner_id=5),), None))
    assert plan.delete_vms == ()


# --------------------------------------------------------------------------------------------
# Orphan registrations


def test_offline_registration_without_vm_is_deleted() -> None:
    plan = decide(snap(runners=(reg(4, "pool-x", online=False),)))
    (r,) = plan.delete_registrations
    assert (r.runner_id, r.name, r.reason) == (4, "pool-x", Reason.ORPHAN_REGISTRATION)
    assert "offline" in r.message


@pytest.mark.parametrize(("online", "busy"), [(True, False), (True, True), (False, True)])
def test_online_or_busy_registration_without_vm_is_left_alone(online: bool, busy: bool) -> None:
    plan = decide(snap(runners=(reg(4, "pool-x", online=online, busy=busy),)))
    assert plan.delete_registrations == ()
    assert any("pool-x" in n for n in plan.notes)


def test_registration_claimed_by_a_vm_is_not_an_orphan() -> None:
    vms = (
        vm("by-name", phase="Pending"),
        vm("gone", deleting=True, runner_id=8),
        vm("done", phase="Failed", runner_id=9),
    )
    runners = (
        reg(1, "by-name", online=False),
        reg(8, "gone", online=False),
        reg(9, "renamed", online=False),
    )
    plan = decide(snap(limits(min_idle=1), vms, runners))
    assert plan.delete_registrations == ()


def test_no_orphan_deletion_without_inventory() -> None:
    assert decide(snap(runners=None)).delete_registrations == ()


# --------------------------------------------------------------------------------------------
# JIT Secrets never written (DESIGN.md: repaired on the next pass)


def test_vm_without_secret_gets_one() -> None:
    plan = decide(snap(limits(min_idle=1), (vm("v", phase="Pending", has_secret=False),)))
    (m,) = plan.mint_secrets
    assert (m.name, m.stale_runner_id) == ("v", None)


def test_stale_registration_reported_for_secret_mint() -> None:
    v = vm("v", phase="Pending", has_secret=False)
    plan = decide(snap(limits(min_idle=1), (v,), (reg(3, "v", online=False),)))
    (m,) = plan.mint_secrets
    assert m.stale_runner_id == 3


def test_mint_replaces_a_recorded_registration_without_secret() -> None:
    """A runner id on the VM but no Secret (the Secret write failed, or it was deleted): the
    registration is unusable, so it is replaced rather than left to the bootstrap timeout."""
    v = vm("v", phase="Pending", has_secret=False, runner_id=3)
    (m,) = decide(snap(limits(min_idle=1), (v,), (reg(3, "v", online=False),))).mint_secrets
    assert m.stale_runner_id == 3
    (m,) = decide(snap(limits(min_idle=1), (v,), ())).mint_secrets  # registration already gone
    assert m.stale_runner_id == 3


def test_no_mint_when_inventory_unknown_or_timed_out() -> None:
    v = vm("v", phase="Pending", has_secret=False)
    assert decide(snap(limits(min_idle=1), (v,), None)).mint_secrets == ()
    v = vm("v", phase="Pending", has_secret=False, created_at=ago(301))
    plan = decide(snap(limits(min_idle=1), (v,)))
    assert plan.mint_secrets == ()
    assert deleted(plan) == {"v": Reason.BOOTSTRAP_TIMEOUT}


# --------------------------------------------------------------------------------------------
# Counts, inputs, helpers


def test_counts_partition_the_pool() -> None:
    a, ra = idle_vm("a", 1)
    vms = (
        a,
        vm("b", job_id=1),
        vm("s", phase="Pending"),
        vm("d", deleting=True),
        vm("f", phase="Failed"),
    )
    c = decide(snap(limits(min_idle=1), vms, (ra,))).counts
    assert (c.starting, c.idle, c.busy, c.terminating, c.total) == (1, 1, 1, 2, 5)


def test_parse_demand() -> None:
    assert parse_demand(None) is None
    assert parse_demand("0") == 0
    assert parse_demand(" 12 ") == 12
    for bad in ("", "-1", "1.5", "two", "\u0661"):
        with pytest.raises(ValueError, match="runner-demand"):
            parse_demand(bad)


def test_limits_from_seed_example_spec() -> None:
    docs = list(
        yaml.safe_load_all((Path(__file__).parent.parent / "data/minimal-example.yaml").read_text())
    )
    pool = next(d for d in docs if d["kind"] == "ImpVMRunnerPool")
    lim = PoolLimits.from_spec(ImpVMRunnerPoolSpec.model_validate(pool["spec"]))
    assert lim == PoolLimits(
        min_idle=1,
        max_concurrent=5,
        scale_up_step=1,
        cooldown_seconds=30,
        bootstrap_timeout_seconds=300,
    )


def test_limits_from_spec_requires_scaling_fields() -> None:
    base = {
        "templateName": "t",
        "platform": {"type": "github-actions", "scope": {"org": "o"}, "credentialsSecret": "s"},
    }
    with pytest.raises(ValueError, match=r"spec\.scaling is required"):
        PoolLimits.from_spec(ImpVMRunnerPoolSpec.model_validate(base))
    spec = ImpVMRunnerPoolSpec.model_validate({**base, "scaling": {"minIdle": 1}})
    with pytest.raises(ValueError, match="maxConcurrent, scaleUpStep, cooldownSeconds"):
        PoolLimits.from_spec(spec)


@pytest.mark.parametrize(
    "kw",
    [
        {"min_idle": -1},
        {"max_concurrent": -1},
        {"scale_up_step": 0},
        {"cooldown_seconds": -1},
        {"bootstrap_timeout_seconds": -1},
    ],
)
def test_limits_reject_out_of_range(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        limits(**kw)


def test_snapshot_rejects_naive_times_duplicates_and_negative_demand() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        SizingFacts(limits=limits(), now=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        snap(vms=(vm("a", created_at=datetime(2026, 1, 1)),))
    with pytest.raises(ValueError, match="unique"):
        snap(vms=(vm("a"), vm("a")))
    with pytest.raises(ValueError, match="queued_jobs"):
        snap(queued_jobs=-1)
    with pytest.raises(ValueError, match="demand_annotation"):
        snap(demand_annotation=-1)


def test_the_vm_read_model_gives_what_sizing_reads() -> None:
    body = {
        "metadata": {"name": "v", "namespace": "ns", "creationTimestamp": "2026-03-01T11:59:51Z"},
        "spec": {**SPEC, "runnerConfigSecret": "v-jit"},
        "status": {
            "phase": "Running",
            "startedAt": "2026-03-01T11:59:55Z",
            "runner": {"id": 3, "name": "v"},
            "job": {"id": 9, "workflowRunId": 4, "repository": "o/r"},
        },
    }
    v = VM.from_body(body)
    assert (v.phase, v.runner_id, v.has_job, v.is_terminal) == ("Running", 3, True, False)
    assert (v.created_at, v.status.started_at) == (ago(9), ago(5))
    assert snap(vms=(v,)).has_secret(v)
    empty = VM.from_body(
        {**body, "status": None, "metadata": {**body["metadata"], "deletionTimestamp": "x"}}
    )
    assert (empty.phase, empty.runner_id, empty.has_job, empty.deleting) == (
        None,
        None,
        False,
        True,
    )


# --------------------------------------------------------------------------------------------
# Properties


PHASES = [None, "Pending", "Scheduled", "Starting", "Running", "Succeeded", "Failed", "Terminating"]


@st.composite
def snapshots(draw: st.DrawFn) -> SizingFacts:
    lim = PoolLimits(
        min_idle=draw(st.integers(0, 6)),
        max_concurrent=draw(st.integers(0, 12)),
        scale_up_step=draw(st.integers(1, 5)),
        cooldown_seconds=draw(st.integers(0, 120)),
        bootstrap_timeout_seconds=draw(st.integers(30, 600)),
    )
    vms: list[VM] = []
    runners: list[RunnerView] = []
    for i in range(draw(st.integers(0, 12))):
        name = f"pool-{i}"
        age = draw(st.integers(0, 1000))
        started = draw(st.none() | st.integers(0, age))
        rid = 100 + i if draw(st.booleans()) else None
        registration = draw(st.sampled_from(["none", "offline", "online", "busy"]))
        vms.append(
            vm(
                name,
                created_at=ago(age),
                phase=draw(st.sampled_from(PHASES)),
                started_at=None if started is None else ago(started),
                deleting=draw(st.booleans()),
                runner_id=rid,
                has_secret=draw(st.booleans()),
                job_id=draw(st.none() | st.integers(1, 10**6)),
            )
        )
        if registration != "none":
            runners.append(
                RunnerView(
                    id=rid if rid is not None else 100 + i,
                    name=name,
                    online=registration in ("online", "busy"),
                    busy=registration == "busy",
                )
            )
    for j in range(draw(st.integers(0, 3))):
        runners.append(
            RunnerView(
                id=500 + j,
                name=f"pool-orphan-{j}",
                online=draw(st.booleans()),
                busy=draw(st.booleans()),
            )
        )
    last = draw(st.none() | st.integers(0, 200))
    return snap(
        lim,
        tuple(vms),
        tuple(runners) if draw(st.sampled_from([True, True, True, False])) else None,
        queued_jobs=draw(st.integers(0, 8)),
        demand_annotation=draw(st.none() | st.integers(0, 8)),
        last_scale_up_time=None if last is None else ago(last),
    )


def _states(s: SizingFacts) -> dict[str, VMState]:
    runners = s.runners or ()
    by_id = {r.id: r for r in runners}
    by_name = {r.name: r for r in runners}
    out = {}
    for v in s.vms:
        r = by_id.get(v.runner_id) if v.runner_id is not None else by_name.get(v.name)
        out[v.name] = classify(v, r)
    return out


@given(snapshots())
@settings(max_examples=400)
def test_prop_creation_bounded_by_step_and_max_concurrent(s: SizingFacts) -> None:
    plan = decide(s)
    assert 0 <= plan.create <= s.limits.scale_up_step
    assert plan.create == 0 or len(s.vms) + plan.create <= s.limits.max_concurrent
    assert plan.scaled_up == (plan.create > 0)


@given(snapshots())
@settings(max_examples=400)
def test_prop_busy_and_terminating_vms_only_deleted_when_terminal(s: SizingFacts) -> None:
    plan = decide(s)
    states = _states(s)
    by_name = {v.name: v for v in s.vms}
    names = [d.name for d in plan.delete_vms]
    assert len(names) == len(set(names))
    for d in plan.delete_vms:
        v = by_name[d.name]
        assert not v.deleting
        if d.reason in (Reason.SUCCEEDED, Reason.FAILED):
            assert v.phase == d.reason.value
        else:
            assert states[d.name] in (VMState.IDLE, VMState.STARTING)
            assert not v.has_job
        assert d.message
        assert not d.deregister_first or d.runner_id is not None
    assert plan.create_reason


@given(snapshots())
@settings(max_examples=300)
def test_prop_counts_partition_and_desired_formula(s: SizingFacts) -> None:
    c = decide(s).counts
    assert c.starting + c.idle + c.busy + c.terminating == c.total == len(s.vms)
    pending = max(s.queued_jobs, s.demand_annotation or 0)
    assert c.pending == pending
    assert c.desired == min(s.limits.max_concurrent, c.busy + pending + s.limits.min_idle)


@given(snapshots())
@settings(max_examples=300)
def test_prop_unknown_inventory_means_no_github_based_action(s: SizingFacts) -> None:
    plan = decide(dataclasses.replace(s, runners=None))
    assert plan.create == 0
    assert plan.delete_registrations == ()
    assert plan.mint_secrets == ()
    assert all(d.reason in (Reason.SUCCEEDED, Reason.FAILED) for d in plan.delete_vms)


@given(snapshots(), st.randoms(use_true_random=False))
@settings(max_examples=200)
def test_prop_decision_ignores_listing_order(s: SizingFacts, rnd: random.Random) -> None:
    assert isinstance(rnd, random.Random)
    vms = list(s.vms)
    rnd.shuffle(vms)
    runners = None if s.runners is None else tuple(rnd.sample(list(s.runners), len(s.runners)))
    assert decide(dataclasses.replace(s, vms=tuple(vms), runners=runners)) == decide(s)


@given(snapshots())
@settings(max_examples=300)
def test_prop_scale_to_zero(s: SizingFacts) -> None:
    s = dataclasses.replace(
        s,
        limits=dataclasses.replace(s.limits, min_idle=0),
        queued_jobs=0,
        demand_annotation=None,
        last_scale_up_time=None,
        runners=s.runners if s.runners is not None else (),
    )
    plan = decide(s)
    assert plan.create == 0
    removed = {d.name for d in plan.delete_vms}
    states = _states(s)
    for name, state in states.items():
        if state in (VMState.IDLE, VMState.STARTING):
            assert name in removed
