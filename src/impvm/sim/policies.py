"""Scaling policies the simulator compares.

* :class:`DeciderPolicy`: this project's pool controller: the real pool pass
  (:func:`impvm.scaling.poolpass.pool_acts`, then :func:`~impvm.scaling.poolpass.conclude_pass`,
  whose memory and status the next pass starts from) over a world the simulator observes as
  the operator would (its VMs as Kubernetes reports them, their runners as GitHub lists them,
  the queued jobs and their arrivals as the job table holds them).
* :class:`ArcPolicy`: ARC's runner scale sets (minRunners + assigned jobs).
* :class:`GarmPolicy`: GARM's pool manager (min idle runners + a runner per queued job).
* :class:`ImpPolicy`: Imp's runner-pool controller (busy runners counted as idle).

Every policy deletes a VM once its job finished (each runner is single-use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from impvm.api.conditions import merge_conditions
from impvm.api.models import ImpVMRunnerPoolSpec, ImpVMRunnerPoolStatus, ScalingSpec
from impvm.api.patches import wire
from impvm.api.vm import VM
from impvm.scaling.jobs import Arrival
from impvm.scaling.poolpass import (
    ActsDone,
    ClassObj,
    Deleted,
    GitHubView,
    PoolMemory,
    PoolObj,
    PoolWorld,
    RunnerView,
    TemplateObj,
    conclude_pass,
    pool_acts,
)
from impvm.scaling.warmpool import WarmPoolState
from impvm.sim.world import (
    CLASS,
    POOL,
    POOL_UID,
    TEMPLATE,
    Actions,
    PoolView,
    busy,
    idle,
    starting,
    trigger_job,
)

__all__ = [
    "GARM_JOB_BACKOFF_SECONDS",
    "ArcPolicy",
    "DeciderPolicy",
    "GarmPolicy",
    "ImpPolicy",
]


def _finished(vms: tuple[VM, ...]) -> list[str]:
    return [vm.name for vm in vms if vm.is_terminal]


def _live(vms: tuple[VM, ...]) -> list[VM]:
    return [vm for vm in vms if not vm.is_terminal]


# --------------------------------------------------------------------------------------------
# This project's pool pass


def _pool_spec(scaling: ScalingSpec) -> ImpVMRunnerPoolSpec:
    """A pool of the simulated template whose jobs arrive as webhook deliveries would."""
    wire_scaling = scaling.wire() | {"mode": "webhook", "webhook": {"secretRef": {"name": "sim"}}}
    return ImpVMRunnerPoolSpec.model_validate(
        {
            "templateName": "sim",
            "labels": ["sim"],
            "platform": {
                "type": "github-actions",
                "scope": {"org": "sim"},
                "credentialsSecret": "sim",
            },
            "scaling": wire_scaling,
        }
    )


def _runner(vm: VM) -> RunnerView | None:
    """The VM's registration as GitHub lists it: from its creation (offline) until its job
    finished (an ephemeral runner deregisters itself then)."""
    if vm.is_terminal:
        return None
    return RunnerView(id=vm.runner_id or 0, name=vm.name, online=not starting(vm), busy=busy(vm))


@dataclass(slots=True)
class DeciderPolicy:
    """The operator's pool pass over the simulated pool (``scaling``: its ``spec.scaling``;
    mode and the rest as a webhook-mode pool). ``start`` is the clock at simulation time 0.
    What a pass concludes is kept as the operator keeps it: the memory in the policy, the
    status as the API server would store it (its write merged in)."""

    name: str
    label: str
    scaling: ScalingSpec
    start: datetime
    tick_seconds: float = 10.0
    tick_mode: str = "resync"
    memory: PoolMemory = field(default_factory=PoolMemory)
    stored: dict[str, Any] = field(default_factory=dict)
    #: (seconds, target) whenever the warm-pool target changed
    targets: list[tuple[float, int]] = field(default_factory=list)
    #: the job arrivals not yet folded into the warm pool, numbered as the job table does
    arrived: list[Arrival] = field(default_factory=list)
    seq: int = 0
    #: each VM's registration, by the VM read model it was made from (the engine hands out
    #: the same object until the VM changes)
    listed: dict[int, tuple[VM, RunnerView | None]] = field(default_factory=dict)
    spec: ImpVMRunnerPoolSpec | None = None

    def _at(self, t: float) -> datetime:
        return self.start + timedelta(seconds=t)

    @property
    def state(self) -> WarmPoolState:
        """The warm pool's estimates as the last pass left them."""
        return self.memory.warm.state or WarmPoolState()

    def _world(self, view: PoolView) -> PoolWorld:
        if self.spec is None:
            self.spec = _pool_spec(self.scaling)
        first = self.seq + 1
        self.arrived += [Arrival(first + i, self._at(t)) for i, t in enumerate(view.arrivals)]
        self.seq += len(view.arrivals)
        cursor = self.memory.warm.cursor
        self.arrived = [a for a in self.arrived if a.seq > cursor]
        pool = PoolObj(
            namespace=POOL,
            name=POOL,
            uid=POOL_UID,
            generation=1,
            spec=self.spec,
            status=ImpVMRunnerPoolStatus.model_validate(self.stored),
            stored_status=self.stored,
        )
        listed = {}
        for vm in view.vms:
            known = self.listed.get(id(vm))
            listed[id(vm)] = known if known is not None and known[0] is vm else (vm, _runner(vm))
        self.listed = listed
        runners = tuple(r for _, r in listed.values() if r is not None)
        return PoolWorld(
            pool=pool,
            now=view.clock,
            mono=view.now,
            template=TemplateObj(name="sim", spec=TEMPLATE),
            vm_class=ClassObj(name=CLASS[0], spec=CLASS[1]),
            vms=view.vms,
            secrets=frozenset(vm.spec.runner_config_secret or "" for vm in view.vms),
            github=GitHubView(connected=True, runners=runners),
            pending_jobs=view.queued,
            arrivals=tuple(self.arrived),
            arrivals_read=self.seq,
            memory=self.memory,
        )

    def plan(self, view: PoolView) -> Actions:
        world = self._world(view)
        acts = pool_acts(world)
        deleted = tuple(Deleted(name=d.name, gone=True) for d in acts.deletions)
        end = conclude_pass(world, acts, ActsDone(created=acts.create, deleted=deleted))
        if end.write:
            conds = merge_conditions(self.stored.get("conditions") or [], end.conditions)
            self.stored = {**self.stored, **wire(end.status), "conditions": conds}
        self.memory = end.memory
        if acts.warm is not None:
            target = acts.warm[0].target
            if not self.targets or self.targets[-1][1] != target:
                self.targets.append((view.now, target))
        return Actions(
            create=acts.create,
            delete=tuple(d.name for d in acts.deletions),
            records=tuple((r.name, wire(r.status)) for r in acts.records),
        )


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
        assigned = view.queued + sum(1 for vm in live if busy(vm))
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
            (vm for vm in live if not busy(vm)),
            key=lambda v: (not starting(v), -v.created_at.timestamp(), v.name),
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
            trigger = trigger_job(vm) if vm is not None else None
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
            idle_or_pending = sum(1 for vm in live if not busy(vm))
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
            idle_vms = [vm for vm in live if idle(vm)]
            surplus = len(idle_vms) - (self.min_idle + view.queued)
            if surplus > 0:
                n = math.ceil(surplus * _GARM_SCALE_DOWN_FACTOR)
                delete += [vm.name for vm in idle_vms[:n]]
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
