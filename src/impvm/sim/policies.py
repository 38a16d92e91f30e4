"""Scaling policies the simulator compares.

* :class:`DeciderPolicy`: this project's pool controller: :func:`impvm.scaling.warm_pool_target`
  (``fixed`` or ``adaptive`` warm pool) gives ``minIdle``, then :func:`impvm.scaling.decide`
  sizes the pool (``desired = min(maxConcurrent, busy + pending + minIdle)``, ``scaleUpStep``,
  ``cooldownSeconds``), both called exactly as the operator calls them, with the pool's VMs and
  runner registrations as Kubernetes and GitHub would report them.
* :class:`ArcPolicy`: ARC's runner scale sets (minRunners + assigned jobs).
* :class:`GarmPolicy`: GARM's pool manager (min idle runners + a runner per queued job).
* :class:`ImpPolicy`: Imp's runner-pool controller (busy runners counted as idle).

Every policy deletes a VM once its job finished (each runner is single-use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from impvm.scaling import PoolLimits, PoolSnapshot, RunnerView, VMView, decide
from impvm.scaling.warmpool import (
    JobQueued,
    RunnerReady,
    WarmPoolEvent,
    WarmPoolPolicy,
    WarmPoolState,
    warm_pool_target,
)
from impvm.sim.world import Actions, PoolView, SimVM

__all__ = [
    "GARM_JOB_BACKOFF_SECONDS",
    "ArcPolicy",
    "DeciderPolicy",
    "GarmPolicy",
    "ImpPolicy",
]


def _finished(vms: tuple[SimVM, ...]) -> list[str]:
    return [vm.name for vm in vms if vm.done]


def _live(vms: tuple[SimVM, ...]) -> list[SimVM]:
    return [vm for vm in vms if not vm.done]


# --------------------------------------------------------------------------------------------
# This project's decider


_Views = tuple[tuple[bool, bool, bool], VMView, RunnerView | None]


def _view(vm: SimVM) -> _Views:
    """A VM and its runner registration as the operator observes them: the VM is Starting until
    its runner is online, then Running, and Succeeded once its job finished; its JIT
    registration exists (offline) from creation, is online once the runner is, busy while the
    job runs, and gone after the job (an ephemeral runner deregisters itself)."""
    phase = "Succeeded" if vm.done else ("Running" if vm.online is not None else "Starting")
    view = VMView(
        name=vm.name,
        created_at=vm.created_at,
        phase=phase,
        started_at=vm.online_at,
        runner_id=vm.runner_id,
        has_secret=True,
        job_id=vm.job if vm.started else None,
    )
    runner = (
        None
        if vm.done
        else RunnerView(
            id=vm.runner_id, name=vm.name, online=vm.online is not None, busy=vm.started
        )
    )
    return (vm.online is not None, vm.started, vm.done), view, runner


@dataclass(slots=True)
class DeciderPolicy:
    """:func:`impvm.scaling.decide` with ``minIdle`` from :func:`impvm.scaling.
    warm_pool_target`, the pass of the operator's pool controller. ``start`` is the clock at
    simulation time 0. The warm pool's events are the jobs queued and the runners that came
    online since the previous pass, each at the time it happened."""

    name: str
    label: str
    limits: PoolLimits
    warm: WarmPoolPolicy
    start: datetime
    tick_seconds: float = 10.0
    tick_mode: str = "resync"
    state: WarmPoolState = field(default_factory=WarmPoolState)
    last_scale_up: datetime | None = None
    #: (seconds, target) whenever the warm-pool target changed
    targets: list[tuple[float, int]] = field(default_factory=list)
    seen: dict[str, _Views] = field(default_factory=dict)

    def _at(self, t: float) -> datetime:
        return self.start + timedelta(seconds=t)

    def plan(self, view: PoolView) -> Actions:
        events: list[WarmPoolEvent] = [JobQueued(self._at(t)) for t in view.arrivals]
        events += [RunnerReady(self._at(t), s) for t, s in view.ready]
        warm = warm_pool_target(self.warm, self.state, events, view.clock)
        self.state = warm.state
        if not self.targets or self.targets[-1][1] != warm.target:
            self.targets.append((view.now, warm.target))
        vms: list[VMView] = []
        runners: list[RunnerView] = []
        cache: dict[str, _Views] = {}
        for vm in view.vms:  # rebuilt only when the VM changed since the previous pass
            known = self.seen.get(vm.name)
            key = (vm.online is not None, vm.started, vm.done)
            entry = known if known is not None and known[0] == key else _view(vm)
            cache[vm.name] = entry
            vms.append(entry[1])
            if entry[2] is not None:
                runners.append(entry[2])
        self.seen = cache
        plan = decide(
            PoolSnapshot(
                limits=replace(self.limits, min_idle=warm.target),
                now=view.clock,
                vms=tuple(vms),
                runners=tuple(runners),
                queued_jobs=view.queued,
                last_scale_up_time=self.last_scale_up,
            )
        )
        if plan.scaled_up:
            self.last_scale_up = view.clock
        return Actions(create=plan.create, delete=tuple(d.name for d in plan.delete_vms))


# --------------------------------------------------------------------------------------------
# ARC


@dataclass(slots=True)
class ArcPolicy:
    """ARC's runner scale sets (actions/actions-runner-controller).

    The listener computes the EphemeralRunnerSet's replicas from each message's statistics:
    ``target = min(maxRunners, minRunners + TotalAssignedJobs)``, where assigned jobs are those
    GitHub gave the scale set, queued or running; on a message with no assigned job and no
    completed job it keeps ``max(last target, target)`` (``setDesiredWorkerState`` in
    ``cmd/ghalistener/worker/worker.go``; the statistics come from
    ``cmd/ghalistener/listener/listener.go``). The EphemeralRunnerSet controller then creates the
    missing runners at once, and scales down by deleting runners that are pending or idle, never
    one running a job (``controllers/actions.github.com/ephemeralrunnerset_controller.go``;
    ``adrs/2022-12-27-pick-the-right-runner-to-scale-down.md``). A message arrives on every
    job event (here: every pass that saw one).
    """

    min_runners: int
    max_runners: int
    name: str = "arc"
    label: str = ""
    tick_seconds: float = 10.0
    tick_mode: str = "resync"
    last_target: int = -1

    def __post_init__(self) -> None:
        self.label = self.label or f"ARC minRunners={self.min_runners}"

    def plan(self, view: PoolView) -> Actions:
        live = _live(view.vms)
        assigned = view.queued + sum(1 for vm in live if vm.busy)
        target = min(self.max_runners, self.min_runners + assigned)
        if assigned == 0 and view.completed == 0:
            target = max(self.last_target, target)  # empty batch
        self.last_target = target
        delete = _finished(view.vms)
        if len(live) < target:
            return Actions(create=target - len(live), delete=tuple(delete))
        surplus = len(live) - target
        # pending runners first, then idle ones (newest first); busy ones are never deleted
        spare = sorted(
            (vm for vm in live if not vm.busy), key=lambda v: (not v.starting, -v.created)
        )
        delete += [vm.name for vm in spare[:surplus]]
        return Actions(delete=tuple(delete))


# --------------------------------------------------------------------------------------------
# GARM

#: GARM's default ``minimum_job_age_backoff`` (seconds a queued job waits for an idle runner
#: before GARM makes one for it; ``database/sql/controller.go``).
GARM_JOB_BACKOFF_SECONDS = 30.0
#: GARM's loop intervals (``runner/common/pool.go``): consolidation (min idle, queued jobs)
#: every 5 s, scale-down every minute; a job still queued 10 minutes after its runner was made
#: is unlocked and retried.
_GARM_CONSOLIDATE = 5.0
_GARM_SCALE_DOWN = 60.0
_GARM_RELOCK = 600.0
_GARM_SCALE_DOWN_FACTOR = 0.5


@dataclass(slots=True)
class GarmPolicy:
    """GARM's pool manager (cloudbase/garm, ``runner/pool/pool.go``).

    - ``ensureIdleRunnersForOnePool`` (every 5 s): create ``minIdleRunners - (idle + pending)``
      runners, up to ``maxRunners`` in all;
    - ``consumeQueuedJobs`` (every 5 s): each queued job not locked and older than the job
      backoff (30 s, so idle runners get the chance to take it) is locked and gets a runner of
      its own; a job still queued 10 minutes after its lock is unlocked and tried again; when a
      runner made for job A starts job B, A's lock is broken (``handleInProgressJob``);
    - ``scaleDownOnePool`` (every minute): ``surplus = idle - (minIdleRunners + queued)``; delete
      ``ceil(surplus * 0.5)`` idle runners.

    So the pool holds ``min idle + queued`` runners, with queued jobs served only after the
    backoff."""

    min_idle: int
    max_runners: int
    backoff_seconds: float = GARM_JOB_BACKOFF_SECONDS
    name: str = "garm"
    label: str = ""
    tick_seconds: float = _GARM_CONSOLIDATE
    tick_mode: str = "loop"
    next_consolidate: float = 0.0
    next_scale_down: float = _GARM_SCALE_DOWN
    #: job -> when it was last updated (queued, locked or unlocked), as GARM's ``UpdatedAt``
    updated: dict[int, float] = field(default_factory=dict)
    locked: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.label = self.label or (
            f"GARM minIdleRunners={self.min_idle} backoff={self.backoff_seconds:g}s"
        )

    def plan(self, view: PoolView) -> Actions:
        now = view.now
        by_name = {vm.name: vm for vm in view.vms}
        for job, q in view.queued_jobs:
            self.updated.setdefault(job, q)
        for job, vm_name in view.started:
            vm = by_name.get(vm_name)
            trigger = vm.trigger_job if vm is not None else None
            self.locked.discard(job)
            if trigger is not None and trigger != job and trigger in self.locked:
                self.locked.discard(trigger)  # BreakLockJobIsQueued
                self.updated[trigger] = now
        delete = _finished(view.vms)
        create = 0
        triggers: list[int | None] = []
        live = _live(view.vms)
        if now >= self.next_consolidate:
            self.next_consolidate = now + _GARM_CONSOLIDATE
            existing = len(live)
            idle_or_pending = sum(1 for vm in live if not vm.busy)
            if existing < self.max_runners and idle_or_pending < self.min_idle:
                create = min(self.min_idle - idle_or_pending, self.max_runners - existing)
            for job, _ in view.queued_jobs:
                age = now - self.updated[job]
                if job in self.locked:
                    if age >= _GARM_RELOCK:
                        self.locked.discard(job)
                        self.updated[job] = now
                    continue
                if age < self.backoff_seconds:
                    continue
                if existing + create >= self.max_runners:
                    break
                self.locked.add(job)
                self.updated[job] = now
                triggers.append(job)
                create += 1
            # jobs no longer queued leave GARM's job table
            queued = {job for job, _ in view.queued_jobs}
            self.locked &= queued
            self.updated = {j: t for j, t in self.updated.items() if j in queued}
        if now >= self.next_scale_down:
            self.next_scale_down = now + _GARM_SCALE_DOWN
            idle = [vm for vm in live if vm.idle]
            surplus = len(idle) - (self.min_idle + view.queued)
            if surplus > 0:
                n = math.ceil(surplus * _GARM_SCALE_DOWN_FACTOR)
                delete += [vm.name for vm in idle[:n]]
        # runners made for min idle come first, those made for jobs carry their job
        pad: list[int | None] = [None] * (create - len(triggers))
        triggers = pad + triggers
        return Actions(create=create, delete=tuple(delete), triggers=tuple(triggers))


# --------------------------------------------------------------------------------------------
# Imp


@dataclass(slots=True)
class ImpPolicy:
    """Imp's runner-pool controller (syscode-labs/imp,
    ``internal/controller/impvmrunnerpool_controller.go``, ``Reconcile``).

    ``desired = max(minIdle, queue depth, runner-demand annotation)`` is compared with every
    non-terminal VM, busy ones included (busy runners are counted as idle capacity):
    ``toCreate = min(desired - active, maxConcurrent - active, scaleUpStep)``, at least 0. It
    never scales down: surplus VMs stay until they ran a job. Reconciles on every VM change and
    requeues after ``cooldownSeconds`` (or the polling interval)."""

    min_idle: int
    max_concurrent: int
    scale_up_step: int
    name: str = "imp"
    label: str = ""
    tick_seconds: float = 30.0
    tick_mode: str = "resync"

    def __post_init__(self) -> None:
        self.label = self.label or f"Imp minIdle={self.min_idle}"

    def plan(self, view: PoolView) -> Actions:
        active = len(_live(view.vms))
        desired = max(self.min_idle, view.queued)
        create = max(0, min(desired - active, self.max_concurrent - active, self.scale_up_step))
        return Actions(create=create, delete=tuple(_finished(view.vms)))
