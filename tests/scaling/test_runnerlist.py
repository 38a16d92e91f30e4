"""How old a shared runner list a pool pass may use (impvm.scaling.runnerlist), and the requeue
that follows from it: pure, with properties over arbitrary clocks and changes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from impvm.scaling.poolpass import UNSCHEDULABLE_AFTER_SECONDS
from impvm.scaling.runnerlist import Listing, awaits_runner, fresh_wait, max_list_age
from impvm.scaling.settings import PassSettings
from tests.scaling.builders import NOW, one_pass, pool_obj, reg, vm, world

S = PassSettings()


def test_a_pool_whose_new_vm_awaits_its_runner_reads_fresh_lists() -> None:
    young = vm("aaaaaa", phase="Pending", created=5.0, runner=(1, False, False), node="n1")
    assert awaits_runner(young)
    assert max_list_age([young], NOW, S) == S.awaiting_runner_list_seconds
    # a job recorded from a webhook: GitHub's list has still not shown the runner up
    took = vm("bbbbbb", created=5.0, runner=(2, False, False), job=7)
    assert awaits_runner(took)
    assert max_list_age([took], NOW, S) == S.awaiting_runner_list_seconds


def test_idle_busy_stuck_and_finished_vms_accept_idle_age_lists() -> None:
    idle = vm("aaaaaa", created=5.0, runner=(1, True, False))
    busy = vm("bbbbbb", created=5.0, runner=(2, False, True), job=7)
    stuck = vm("cccccc", phase="Starting", created=S.runner_wait_fresh_seconds + 1)
    done = vm("dddddd", phase="Succeeded", created=5.0)
    gone = vm("eeeeee", phase="Pending", created=5.0, deleting=True, node="n1")
    unclaimed = vm("ffffff", phase="Pending", created=5.0)  # no agent took it: no runner yet
    for v in (idle, busy, done, gone, unclaimed):
        assert not awaits_runner(v), v.name
    assert awaits_runner(stuck)
    everything = [idle, busy, stuck, done, gone, unclaimed]
    assert max_list_age(everything, NOW, S) == S.idle_runner_list_seconds
    assert max_list_age([], NOW, S) == S.idle_runner_list_seconds


@given(
    started=st.floats(0, 1e6),
    age=st.floats(0, 1e4),
    max_age=st.floats(0, 1e4),
    changed=st.one_of(st.none(), st.floats(0, 1e6)),
)
def test_a_list_begun_before_the_pools_last_change_is_never_used(
    started: float, age: float, max_age: float, changed: float | None
) -> None:
    """Used iff it is young enough and begun after the pool's last registration change."""
    now = started + age
    used = Listing(started).usable(now, max_age, changed)
    assert used == ((changed is None or started > changed) and now - started <= max_age)


@given(st.lists(st.floats(0, 200), max_size=6), st.booleans())
def test_the_accepted_age_is_short_exactly_when_a_young_vm_awaits_its_runner(
    ages: list[float], online: bool
) -> None:
    vms = [
        vm(f"{i:06x}", phase="Starting", created=a, runner=(i + 1, online, False), node="n1")
        for i, a in enumerate(ages)
    ]
    young = not online and any(a < S.runner_wait_fresh_seconds for a in ages)
    assert fresh_wait(vms, NOW, S) == young
    want = S.awaiting_runner_list_seconds if young else S.idle_runner_list_seconds
    assert max_list_age(vms, NOW, S) == want


def test_a_vm_stuck_awaiting_its_runner_does_not_keep_the_pool_on_the_busy_resync() -> None:
    """Fresh starting VMs requeue at busy resync; once older than the wait window, the pool is
    resynced at the idle interval (the bootstrap timeout removes it)."""
    pool = pool_obj(minIdle=1)
    fresh = vm("aaaaaa", phase="Starting", created=5.0, runner=(1, False, False))
    w = world((fresh,), (reg(1, "aaaaaa", online=False),), pool=pool)
    assert one_pass(w)[1].requeue == S.busy_resync_seconds
    stuck = vm("aaaaaa", phase="Starting", created=120.0, runner=(1, False, False))
    w = world((stuck,), (reg(1, "aaaaaa", online=False),), pool=pool)
    acts, end = one_pass(w)
    assert acts.sizing is not None and acts.sizing.counts.starting == 1
    assert end.requeue == S.resync_seconds


def test_an_unclaimed_vm_requeues_its_pool_when_it_becomes_unschedulable() -> None:
    """A VM no agent took keeps no busy resync (its runner cannot come online), but the pass
    comes back the moment it has waited long enough for the Unschedulable condition."""
    pool = pool_obj(minIdle=1)
    waiting = vm("aaaaaa", phase="Pending", created=5.0, runner=(1, False, False))
    w = world((waiting,), (reg(1, "aaaaaa", online=False),), pool=pool)
    assert one_pass(w)[1].requeue == UNSCHEDULABLE_AFTER_SECONDS - 5.0
    late = vm("aaaaaa", phase="Pending", created=100.0, runner=(1, False, False))
    w = world((late,), (reg(1, "aaaaaa", online=False),), pool=pool)
    assert one_pass(w)[1].requeue == S.resync_seconds
