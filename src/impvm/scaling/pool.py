"""Pool sizing and two-way reconciliation with GitHub: one pure decision per reconcile pass.

``decide(snapshot) -> ScalePlan``. The pool pass (:mod:`impvm.scaling.poolpass`) builds a
:class:`PoolSnapshot` — the pool's limits, its ImpVMs as Kubernetes reports them, the pool's
runner registrations as GitHub reports them, the demand signals and the clock — and carries out
the returned :class:`ScalePlan`. Nothing here does I/O or reads a clock.

Rules and their sources:

* Pool sizing: terminal VMs (``Succeeded``/``Failed``) are deleted, each runner being
  single-use; ``desired = min(maxConcurrent, busy + pending + minIdle)`` with
  ``pending = max(queued matching jobs, imp.dev/runner-demand)``; at most ``scaleUpStep`` VMs are
  created per pass; never more than ``maxConcurrent`` VMs exist at once (VMs being deleted still
  hold resources and count); surplus idle runners are removed only once ``cooldownSeconds`` have
  passed since the last scale-up; a scale-down never deletes a busy runner; with ``minIdle`` 0
  and no demand the pool scales to zero.
* Two-way reconciliation (GARM-style, touching only this pool's runners): a registration with
  no VM is deleted once offline; a VM whose runner has not come online within
  ``bootstrapTimeoutSeconds`` is deleted together with its registration; a VM whose registration
  vanished while idle is deleted so that a replacement is made.
* Idempotent, level-triggered: a VM whose JIT Secret was never written gets one
  (:attr:`ScalePlan.mint_secrets`), or is replaced by the bootstrap timeout.
* Template roll-out (ARC: a spec-hash change recycles idle runners only): a VM made from an
  older template (:attr:`VMView.outdated`) does not count as supply, so a replacement is made;
  an outdated VM that is not busy is deleted, at most ``scaleUpStep`` per pass, and an idle one
  only while at least ``minIdle`` idle runners remain; a busy one finishes its job first.

How the caller should observe, so the decision is sound:

* List the pool's GitHub registrations **before** listing its ImpVMs. A JIT registration is
  made only after its VM exists (VM before Secret), so every registration seen then has its VM
  in the VM list and is never mistaken for an orphan.
* Pass ``runners=None`` when the registrations could not be listed this pass (GitHub
  unavailable, rate-limited): the plan then makes no GitHub-based decision at all, and each VM
  counts as its recorded ``status.runner`` says (an idle runner stays idle, not starting).

All durations are in seconds; every datetime must be timezone-aware.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from impvm.api.models import TERMINAL_PHASES, ImpVMRunnerPoolSpec, ImpVMStatus, VMPhase

__all__ = [
    "DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS",
    "Counts",
    "PoolLimits",
    "PoolSnapshot",
    "Reason",
    "RegistrationDeletion",
    "RunnerView",
    "ScalePlan",
    "SecretMint",
    "VMDeletion",
    "VMState",
    "VMView",
    "classify",
    "decide",
    "parse_demand",
]

#: Default of ``ImpVMRunnerPool.spec.bootstrapTimeoutSeconds``.
DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS = 300

#: Phase of a VM the agent is shutting down: it still holds resources but takes no job.
_TERMINATING_PHASE = VMPhase.TERMINATING


class Reason(StrEnum):
    """CamelCase reasons of deletions (usable as Kubernetes Event reasons and metric labels)."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    BOOTSTRAP_TIMEOUT = "BootstrapTimeout"
    REGISTRATION_VANISHED = "RegistrationVanished"
    SURPLUS = "Surplus"
    OUTDATED = "Outdated"
    ORPHAN_REGISTRATION = "OrphanRegistration"


class VMState(StrEnum):
    """How one VM counts towards the pool (see :func:`classify`)."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    TERMINATING = "terminating"


def _require_aware(what: str, value: datetime | None) -> None:
    if value is not None and value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {value!r}")


def _require_non_negative(what: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True, slots=True, kw_only=True)
class VMView:
    """What Kubernetes says about one ImpVM of the pool.

    - ``name``: the ImpVM's name; its runner registers under the same name.
    - ``phase``: ``status.phase`` (Pending, Scheduled, Starting, Running, Succeeded, Failed,
      Terminating) or None before the agent reported one.
    - ``created_at``: ``metadata.creationTimestamp``; ``started_at``: ``status.startedAt``.
    - ``deleting``: ``metadata.deletionTimestamp`` is set.
    - ``runner_id``: ``status.runner.id``, recorded when the JIT config was minted.
    - ``has_secret``: the JIT Secret named by ``spec.runnerConfigSecret`` exists.
    - ``job_id``: ``status.job.id``, recorded once the runner took a job.
    - ``runner_online`` / ``runner_busy``: ``status.runner.online`` / ``.busy`` as last copied
      from GitHub (used only when the registrations cannot be listed this pass).
    - ``outdated``: the VM was made from another template than the pool's current one.
    """

    name: str
    created_at: datetime
    phase: str | None = None
    started_at: datetime | None = None
    deleting: bool = False
    runner_id: int | None = None
    has_secret: bool = False
    job_id: int | None = None
    runner_online: bool | None = None
    runner_busy: bool | None = None
    outdated: bool = False

    def __post_init__(self) -> None:
        _require_aware(f"VM {self.name} created_at", self.created_at)
        _require_aware(f"VM {self.name} started_at", self.started_at)

    @classmethod
    def from_status(
        cls,
        *,
        name: str,
        created_at: datetime,
        deleting: bool,
        has_secret: bool,
        status: ImpVMStatus | None,
        outdated: bool = False,
    ) -> VMView:
        """Build a view from an ImpVM's metadata facts and its parsed ``status``."""
        s = status or ImpVMStatus()
        return cls(
            name=name,
            created_at=created_at,
            phase=s.phase,
            started_at=s.started_at,
            deleting=deleting,
            runner_id=s.runner.id if s.runner else None,
            has_secret=has_secret,
            job_id=s.job.id if s.job else None,
            runner_online=s.runner.online if s.runner else None,
            runner_busy=s.runner.busy if s.runner else None,
            outdated=outdated,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerView:
    """What GitHub says about one runner registration whose name starts with the pool's prefix
    (``GET /orgs/{org}/actions/runners`` or the repository form): ``id``, ``name``, ``online``
    (``status == "online"``) and ``busy``."""

    id: int
    name: str
    online: bool
    busy: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLimits:
    """The pool's sizing limits (``spec.scaling`` and ``spec.bootstrapTimeoutSeconds``).

    Counts are VMs; ``cooldown_seconds`` and ``bootstrap_timeout_seconds`` are seconds.
    """

    min_idle: int
    max_concurrent: int
    scale_up_step: int
    cooldown_seconds: int
    bootstrap_timeout_seconds: int = DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        _require_non_negative("min_idle", self.min_idle)
        _require_non_negative("max_concurrent", self.max_concurrent)
        _require_non_negative("cooldown_seconds", self.cooldown_seconds)
        _require_non_negative("bootstrap_timeout_seconds", self.bootstrap_timeout_seconds)
        if self.scale_up_step < 1:
            raise ValueError(f"scale_up_step must be >= 1, got {self.scale_up_step}")

    @classmethod
    def from_spec(cls, spec: ImpVMRunnerPoolSpec) -> PoolLimits:
        """Limits of a pool spec.

        Raises ValueError naming the field when ``scaling`` or one of ``minIdle``,
        ``maxConcurrent``, ``scaleUpStep``, ``cooldownSeconds`` is missing (the CRD's CEL rules
        require them for github-actions pools).
        """
        sc = spec.scaling
        if sc is None:
            raise ValueError("spec.scaling is required")
        missing = [
            wire
            for wire, value in (
                ("minIdle", sc.min_idle),
                ("maxConcurrent", sc.max_concurrent),
                ("scaleUpStep", sc.scale_up_step),
                ("cooldownSeconds", sc.cooldown_seconds),
            )
            if value is None
        ]
        if missing:
            raise ValueError(f"spec.scaling.{', '.join(missing)} required")
        assert sc.min_idle is not None and sc.max_concurrent is not None
        assert sc.scale_up_step is not None and sc.cooldown_seconds is not None
        return cls(
            min_idle=sc.min_idle,
            max_concurrent=sc.max_concurrent,
            scale_up_step=sc.scale_up_step,
            cooldown_seconds=sc.cooldown_seconds,
            bootstrap_timeout_seconds=spec.bootstrap_timeout_seconds,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSnapshot:
    """Everything one decision needs.

    - ``limits``: :class:`PoolLimits`.
    - ``now``: the pass's clock reading (timezone-aware).
    - ``last_scale_up_time``: ``status.lastScaleUpTime``; None means never (cooldown elapsed).
    - ``vms``: every ImpVM labelled ``imp.dev/runner-pool=<pool>`` (names unique).
    - ``runners``: the pool's registrations on GitHub, or None when unknown this pass.
    - ``queued_jobs``: queued jobs routed to this pool by the poller (0 when not polling).
    - ``demand_annotation``: the ``imp.dev/runner-demand`` value (see :func:`parse_demand`).
    """

    limits: PoolLimits
    now: datetime
    vms: tuple[VMView, ...] = ()
    runners: tuple[RunnerView, ...] | None = ()
    queued_jobs: int = 0
    demand_annotation: int | None = None
    last_scale_up_time: datetime | None = None

    def __post_init__(self) -> None:
        _require_aware("now", self.now)
        _require_aware("last_scale_up_time", self.last_scale_up_time)
        _require_non_negative("queued_jobs", self.queued_jobs)
        if self.demand_annotation is not None:
            _require_non_negative("demand_annotation", self.demand_annotation)
        names = [vm.name for vm in self.vms]
        if len(set(names)) != len(names):
            raise ValueError("VM names must be unique")


def parse_demand(raw: str | None) -> int | None:
    """Parse the ``imp.dev/runner-demand`` annotation: None when absent, else a non-negative
    integer (surrounding whitespace allowed). Raises ValueError with a readable message otherwise
    (the caller reports it on the pool and treats the demand as absent)."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"imp.dev/runner-demand must be a non-negative integer, got {raw!r}")
    return int(text)


# --------------------------------------------------------------------------------------------
# Outputs


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    """The pool as observed at the start of the pass (before this plan is carried out), plus
    the target: ``starting``, ``idle``, ``busy``, ``terminating`` (deleting, Terminating or
    terminal) partition ``total`` (every VM of the pool); ``desired`` is the live VM count the
    controller aims for and ``pending`` the demand it used; ``outdated`` counts the live VMs
    made from an older template. Fits ``ImpVMRunnerPoolStatus``."""

    starting: int
    idle: int
    busy: int
    terminating: int
    total: int
    desired: int
    pending: int
    outdated: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class VMDeletion:
    """Delete ImpVM ``name``.

    When ``deregister_first`` is true, first delete the GitHub registration ``runner_id``; if
    GitHub refuses because the runner is busy (HTTP 422), keep the VM — it took a job meanwhile.
    ``runner_id`` is informational when ``deregister_first`` is false.
    """

    name: str
    runner_id: int | None
    reason: Reason
    message: str
    deregister_first: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationDeletion:
    """Delete GitHub runner registration ``runner_id`` (named ``name``), which has no VM."""

    runner_id: int
    name: str
    reason: Reason
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SecretMint:
    """Mint a JIT config for VM ``name`` and write its Secret (it was never written).

    ``stale_runner_id``: a registration already carries the VM's name (a JIT config minted by a
    pass that crashed before storing it); delete it first, or GitHub answers 409.
    """

    name: str
    stale_runner_id: int | None
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalePlan:
    """What to do this pass.

    - ``counts``: :class:`Counts`.
    - ``create``: number of new ImpVMs to create (each then gets its JIT Secret).
    - ``create_reason``: why ``create`` has its value (a sentence with the arithmetic).
    - ``delete_vms``: :class:`VMDeletion` s, terminal first, then GitHub-based, then surplus,
      then outdated (template roll-out).
    - ``delete_registrations``: :class:`RegistrationDeletion` s of offline orphans.
    - ``mint_secrets``: :class:`SecretMint` s for VMs lacking their JIT Secret.
    - ``scaled_up``: ``create > 0``; the caller then sets ``status.lastScaleUpTime = now``.
    - ``notes``: sentences on decisions *not* to act (cooldown, unknown inventory).
    """

    counts: Counts
    create: int
    create_reason: str
    delete_vms: tuple[VMDeletion, ...] = ()
    delete_registrations: tuple[RegistrationDeletion, ...] = ()
    mint_secrets: tuple[SecretMint, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def scaled_up(self) -> bool:
        """Whether this pass creates VMs (a scale-up restarts the cooldown)."""
        return self.create > 0


# --------------------------------------------------------------------------------------------
# Decision


@dataclass(frozen=True, slots=True)
class _Inventory:
    by_id: dict[int, RunnerView]
    by_name: dict[str, RunnerView]

    @classmethod
    def of(cls, runners: Iterable[RunnerView]) -> _Inventory:
        rs = list(runners)
        return cls({r.id: r for r in rs}, {r.name: r for r in rs})

    def registration(self, vm: VMView) -> RunnerView | None:
        """The VM's registration: by its recorded runner id, else by name (runner name = VM
        name)."""
        if vm.runner_id is not None:
            return self.by_id.get(vm.runner_id)
        return self.by_name.get(vm.name)


def classify(vm: VMView, registration: RunnerView | None) -> VMState:
    """How ``vm`` counts, given its GitHub ``registration`` (None: absent or unknown).

    terminating: being deleted, phase Terminating, or terminal (Succeeded/Failed);
    busy: a job is recorded on the VM, or GitHub reports its runner busy;
    idle: its runner is online and not busy; starting: anything else (not yet online).
    """
    if vm.deleting or vm.phase == _TERMINATING_PHASE or vm.phase in TERMINAL_PHASES:
        return VMState.TERMINATING
    if vm.job_id is not None or (registration is not None and registration.busy):
        return VMState.BUSY
    if registration is not None and registration.online:
        return VMState.IDLE
    return VMState.STARTING


def _recorded(vm: VMView) -> RunnerView | None:
    """The VM's runner as its status last recorded it (for a pass that cannot list them)."""
    if vm.runner_online is None and vm.runner_busy is None:
        return None
    return RunnerView(
        id=vm.runner_id or 0,
        name=vm.name,
        online=bool(vm.runner_online),
        busy=bool(vm.runner_busy),
    )


def _age_seconds(now: datetime, since: datetime) -> float:
    return (now - since).total_seconds()


def _surplus_order(pairs: Iterable[tuple[VMView, VMState]]) -> list[tuple[VMView, VMState]]:
    """Removal order of surplus VMs: starting VMs first (no online registration, so no job can
    race onto them), then idle; newest first within each; name (descending) last."""
    by_name = sorted(pairs, key=lambda p: p[0].name, reverse=True)
    return sorted(
        by_name,
        key=lambda p: (0 if p[1] is VMState.STARTING else 1, -p[0].created_at.timestamp()),
    )


def decide(snapshot: PoolSnapshot) -> ScalePlan:
    """Decide one reconcile pass of a pool (see the module docstring for the rules).

    Shape: ``PoolSnapshot -> ScalePlan``. Pure and deterministic. Deletions decided in this pass
    do not free capacity until they complete: ``len(snapshot.vms) + plan.create`` never exceeds
    ``max_concurrent`` (nor does ``create`` exceed ``scale_up_step``). No VM classified busy is
    ever deleted. With ``runners=None`` only terminal VMs are deleted and nothing is created,
    deregistered or minted (each of those needs GitHub).
    """
    lim = snapshot.limits
    now = snapshot.now
    inventory_known = snapshot.runners is not None
    inv = _Inventory.of(snapshot.runners or ())

    terminal: list[VMDeletion] = []
    github_based: list[VMDeletion] = []
    mints: list[SecretMint] = []
    notes: list[str] = []
    observed = dict.fromkeys(VMState, 0)
    kept: list[tuple[VMView, VMState]] = []  # live VMs not deleted this pass

    for vm in sorted(snapshot.vms, key=lambda v: v.name):
        reg = inv.registration(vm) if inventory_known else _recorded(vm)
        state = classify(vm, reg)
        observed[state] += 1
        if state is VMState.TERMINATING:
            if not vm.deleting and vm.phase in TERMINAL_PHASES:
                reason = Reason.SUCCEEDED if vm.phase == "Succeeded" else Reason.FAILED
                terminal.append(
                    VMDeletion(
                        name=vm.name,
                        runner_id=vm.runner_id,
                        reason=reason,
                        message=f"VM {vm.name} is {vm.phase}; each runner is single-use",
                        deregister_first=False,
                    )
                )
            continue
        if not inventory_known:
            kept.append((vm, state))
            continue
        if (
            state is not VMState.BUSY
            and reg is None
            and vm.runner_id is not None
            and vm.phase == "Running"
        ):
            github_based.append(
                VMDeletion(
                    name=vm.name,
                    runner_id=vm.runner_id,
                    reason=Reason.REGISTRATION_VANISHED,
                    message=f"runner {vm.runner_id} of running VM {vm.name} is no longer "
                    "registered on GitHub and has no job; replacing the VM",
                    deregister_first=False,
                )
            )
            continue
        if state is VMState.STARTING:
            since = vm.started_at or vm.created_at
            age = _age_seconds(now, since)
            if age > lim.bootstrap_timeout_seconds:
                runner_id = reg.id if reg is not None else vm.runner_id
                what = "started" if vm.started_at is not None else "created"
                github_based.append(
                    VMDeletion(
                        name=vm.name,
                        runner_id=runner_id,
                        reason=Reason.BOOTSTRAP_TIMEOUT,
                        message=f"runner of VM {vm.name} not online {int(age)}s after the VM "
                        f"was {what} (bootstrap timeout {lim.bootstrap_timeout_seconds}s)",
                        deregister_first=runner_id is not None,
                    )
                )
                continue
            if not vm.has_secret:
                # a registration for this VM without its Secret (a pass crashed after the
                # JIT call, or the Secret was deleted) can never be used: replace it
                stale = inv.by_name.get(vm.name)
                stale_id = stale.id if stale is not None else vm.runner_id
                mints.append(
                    SecretMint(
                        name=vm.name,
                        stale_runner_id=stale_id,
                        message=f"VM {vm.name} has no JIT Secret yet",
                    )
                )
        kept.append((vm, state))

    # Registrations this pool made that no VM accounts for.
    orphans: list[RegistrationDeletion] = []
    if inventory_known:
        claimed_ids = {vm.runner_id for vm in snapshot.vms if vm.runner_id is not None}
        vm_names = {vm.name for vm in snapshot.vms}
        for r in sorted(snapshot.runners or (), key=lambda r: (r.name, r.id)):
            if r.id in claimed_ids or r.name in vm_names:
                continue
            if r.online or r.busy:
                notes.append(
                    f"registration {r.name} (id {r.id}) has no VM but is "
                    f"{'busy' if r.busy else 'online'}; left alone until offline"
                )
                continue
            orphans.append(
                RegistrationDeletion(
                    runner_id=r.id,
                    name=r.name,
                    reason=Reason.ORPHAN_REGISTRATION,
                    message=f"registration {r.name} (id {r.id}) is offline and has no VM",
                )
            )

    # outdated VMs that are not busy are being replaced: they are not supply
    replaced = [(vm, s) for vm, s in kept if vm.outdated and s is not VMState.BUSY]
    current = [(vm, s) for vm, s in kept if not (vm.outdated and s is not VMState.BUSY)]
    busy = sum(1 for _, s in kept if s is VMState.BUSY)
    idle = sum(1 for _, s in current if s is VMState.IDLE)
    starting = sum(1 for _, s in current if s is VMState.STARTING)
    supply = busy + idle + starting
    demand_note = (
        f"queued {snapshot.queued_jobs}, annotation "
        f"{'unset' if snapshot.demand_annotation is None else snapshot.demand_annotation}"
    )
    pending = max(snapshot.queued_jobs, snapshot.demand_annotation or 0)
    desired = min(lim.max_concurrent, busy + pending + lim.min_idle)
    formula = (
        f"desired {desired} = min(maxConcurrent {lim.max_concurrent}, busy {busy} + pending "
        f"{pending} ({demand_note}) + minIdle {lim.min_idle}); have {supply} live "
        f"(idle {idle}, starting {starting}, busy {busy})"
    )
    if replaced:
        formula += f" and {len(replaced)} outdated being replaced"

    create = 0
    surplus_deletions: list[VMDeletion] = []
    if supply < desired:
        need = desired - supply
        headroom = max(0, lim.max_concurrent - len(snapshot.vms))
        if not inventory_known:
            create_reason = (
                f"{formula}; {need} short, but creating none: the GitHub runner inventory is "
                "unknown this pass and a new VM needs a JIT config from GitHub"
            )
        else:
            create = min(need, lim.scale_up_step, headroom)
            create_reason = (
                f"{formula}; creating {create} of {need} short (scaleUpStep "
                f"{lim.scale_up_step}, headroom {headroom} = maxConcurrent {lim.max_concurrent} "
                f"- {len(snapshot.vms)} VMs incl. terminating)"
            )
    elif supply == desired:
        create_reason = f"{formula}; nothing to create"
    else:
        surplus = supply - desired
        create_reason = f"{formula}; {surplus} surplus, nothing to create"
        elapsed = (
            None
            if snapshot.last_scale_up_time is None
            else _age_seconds(now, snapshot.last_scale_up_time)
        )
        removable = _surplus_order(
            (vm, s) for vm, s in current if s in (VMState.IDLE, VMState.STARTING)
        )
        if not inventory_known:
            notes.append(
                f"{surplus} surplus kept: the GitHub runner inventory is unknown, so runners "
                "cannot be deregistered safely this pass"
            )
        elif elapsed is not None and elapsed < lim.cooldown_seconds:
            notes.append(
                f"{surplus} surplus kept: {int(elapsed)}s since the last scale-up, cooldown "
                f"{lim.cooldown_seconds}s"
            )
        else:
            ago = "no scale-up recorded" if elapsed is None else f"{int(elapsed)}s since"
            for vm, s in removable[:surplus]:
                reg = inv.registration(vm)
                runner_id = reg.id if reg is not None else vm.runner_id
                surplus_deletions.append(
                    VMDeletion(
                        name=vm.name,
                        runner_id=runner_id,
                        reason=Reason.SURPLUS,
                        message=f"{s.value} VM {vm.name} is surplus ({supply} live, desired "
                        f"{desired}; cooldown {lim.cooldown_seconds}s elapsed, {ago} the "
                        "last scale-up)",
                        deregister_first=runner_id is not None,
                    )
                )
            if len(removable) < surplus:
                notes.append(
                    f"{surplus - len(removable)} surplus VMs are busy and are never scaled down"
                )

    rollout: list[VMDeletion] = []
    if replaced and inventory_known:
        surplus_idle = {d.name for d in surplus_deletions}
        ready = sum(1 for vm, s in kept if s is VMState.IDLE and vm.name not in surplus_idle)
        oldest_first = sorted(
            replaced,
            key=lambda p: (p[1] is VMState.IDLE, p[0].created_at.timestamp(), p[0].name),
        )
        waiting = 0
        for vm, s in oldest_first:
            if len(rollout) >= lim.scale_up_step:
                break
            if s is VMState.IDLE:
                if ready - 1 < lim.min_idle:
                    waiting += 1
                    continue
                ready -= 1
            reg = inv.registration(vm)
            runner_id = reg.id if reg is not None else vm.runner_id
            rollout.append(
                VMDeletion(
                    name=vm.name,
                    runner_id=runner_id,
                    reason=Reason.OUTDATED,
                    message=f"{s.value} VM {vm.name} was made from an older template; "
                    f"replacing it ({ready} idle runners stay ready, minIdle {lim.min_idle})",
                    deregister_first=runner_id is not None,
                )
            )
        if waiting:
            notes.append(
                f"{waiting} outdated idle VMs kept until replacements are ready "
                f"(minIdle {lim.min_idle})"
            )
    elif replaced:
        notes.append(
            f"{len(replaced)} outdated VMs kept: the GitHub runner inventory is unknown, so "
            "runners cannot be deregistered safely this pass"
        )

    removed = {d.name for d in (*surplus_deletions, *rollout)}
    counts = Counts(
        starting=observed[VMState.STARTING],
        idle=observed[VMState.IDLE],
        busy=observed[VMState.BUSY],
        terminating=observed[VMState.TERMINATING],
        total=len(snapshot.vms),
        desired=desired,
        pending=pending,
        outdated=sum(1 for vm, _ in kept if vm.outdated),
    )
    return ScalePlan(
        counts=counts,
        create=create,
        create_reason=create_reason,
        delete_vms=(*terminal, *github_based, *surplus_deletions, *rollout),
        delete_registrations=tuple(orphans),
        # a VM removed this pass (surplus, outdated) needs no JIT config any more
        mint_secrets=tuple(m for m in mints if m.name not in removed),
        notes=tuple(notes),
    )
