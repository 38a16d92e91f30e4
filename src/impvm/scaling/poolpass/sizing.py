"""The terms of pool sizing: what :func:`~impvm.scaling.poolpass.size.size_pool` reads
(:class:`SizingFacts`, :class:`PoolLimits`) and decides (:class:`Sizing`), and how one VM counts
(:func:`classify`: busy is what any witness says). The rules are in
:mod:`~impvm.scaling.poolpass.size`. Pure; durations are seconds, datetimes timezone-aware."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from impvm.api.models import ImpVMRunnerPoolSpec, VMPhase
from impvm.api.times import require_aware
from impvm.api.vm import VM
from impvm.scaling.poolpass.world import RunnerView

__all__ = [
    "DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS",
    "Counts",
    "Inventory",
    "PoolLimits",
    "Reason",
    "RegistrationDeletion",
    "SecretMint",
    "Sizing",
    "SizingFacts",
    "VMDeletion",
    "VMState",
    "classify",
    "parse_demand",
    "recorded_runner",
]

#: Default of ``ImpVMRunnerPool.spec.bootstrapTimeoutSeconds``.
DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS = 300


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


def _require_non_negative(what: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLimits:
    """The pool's sizing limits (``spec.scaling`` and ``spec.bootstrapTimeoutSeconds``): counts
    are VMs, ``cooldown_seconds`` and ``bootstrap_timeout_seconds`` seconds."""

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
        """Limits of a pool spec. Raises ValueError naming the field when ``scaling`` or one of
        ``minIdle``, ``maxConcurrent``, ``scaleUpStep``, ``cooldownSeconds`` is missing (the
        CRD's CEL rules require them for github-actions pools)."""
        sc = spec.scaling
        if sc is None:
            raise ValueError("spec.scaling is required")
        fields = (
            ("minIdle", sc.min_idle),
            ("maxConcurrent", sc.max_concurrent),
            ("scaleUpStep", sc.scale_up_step),
            ("cooldownSeconds", sc.cooldown_seconds),
        )
        missing = [wire for wire, value in fields if value is None]
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
class SizingFacts:
    """Everything one sizing needs.

    - ``limits``; ``now`` (timezone-aware); ``last_scale_up_time`` (None: never);
    - ``vms``: every ImpVM of the pool (names unique); ``secrets``: the JIT Secrets that exist;
      ``outdated``: VMs made from another template than the pool's current one;
    - ``runners``: the pool's registrations on GitHub, None when unknown this pass;
    - ``running`` / ``finished``: runners a job record names in progress / completed;
    - ``queued_jobs``: queued jobs routed to the pool; ``demand_annotation``: the
      ``imp.dev/runner-demand`` value (:func:`parse_demand`).
    """

    limits: PoolLimits
    now: datetime
    vms: tuple[VM, ...] = ()
    runners: tuple[RunnerView, ...] | None = ()
    secrets: frozenset[str] = frozenset()
    outdated: frozenset[str] = frozenset()
    running: frozenset[str] = frozenset()
    finished: frozenset[str] = frozenset()
    queued_jobs: int = 0
    demand_annotation: int | None = None
    last_scale_up_time: datetime | None = None

    def __post_init__(self) -> None:
        require_aware("now", self.now)
        require_aware("last_scale_up_time", self.last_scale_up_time)
        _require_non_negative("queued_jobs", self.queued_jobs)
        if self.demand_annotation is not None:
            _require_non_negative("demand_annotation", self.demand_annotation)
        names = [vm.name for vm in self.vms]
        if len(set(names)) != len(names):
            raise ValueError("VM names must be unique")
        for vm in self.vms:
            require_aware(f"VM {vm.name} created_at", vm.created_at)

    def has_secret(self, vm: VM) -> bool:
        """The JIT Secret ``spec.runnerConfigSecret`` names exists."""
        return bool(vm.spec.runner_config_secret) and vm.spec.runner_config_secret in self.secrets


def parse_demand(raw: str | None) -> int | None:
    """Parse the ``imp.dev/runner-demand`` annotation: None when absent, else a non-negative
    integer (surrounding whitespace allowed). Raises ValueError with a readable message
    otherwise (the caller reports it on the pool and treats the demand as absent)."""
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
    """The pool as observed at the start of the pass, plus the target: ``starting``, ``idle``,
    ``busy``, ``terminating`` (deleting, Terminating, terminal, or its job done) partition
    ``total``; ``desired`` is the live VM count aimed for and ``pending`` the demand it used;
    ``outdated`` counts the live VMs made from an older template."""

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
    """Delete ImpVM ``name``. With ``deregister_first`` its GitHub registration ``runner_id``
    goes first, and the VM stays when GitHub refuses because the runner is busy (422: it took a
    job meanwhile); else ``runner_id`` is deregistered at best."""

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
    """Mint a JIT config for VM ``name`` and write its Secret (it was never written);
    ``stale_runner_id``: a registration already carries the VM's name (minted by a pass that
    crashed before storing it): delete it first, or GitHub answers 409."""

    name: str
    stale_runner_id: int | None
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """The pool's size this pass: ``counts``; ``create`` new ImpVMs (each then gets its JIT
    Secret) and ``create_reason`` (the arithmetic); ``delete_vms`` (terminal first, then
    GitHub-based, then surplus, then outdated); ``delete_registrations`` (offline orphans);
    ``mint_secrets``; ``notes``: sentences on decisions *not* to act."""

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
class Inventory:
    """The pool's registrations by id and by name."""

    by_id: dict[int, RunnerView]
    by_name: dict[str, RunnerView]

    @classmethod
    def of(cls, runners: tuple[RunnerView, ...] | None) -> Inventory:
        rs = list(runners or ())
        return cls({r.id: r for r in rs}, {r.name: r for r in rs})

    def registration(self, vm: VM) -> RunnerView | None:
        """The VM's registration: by its recorded runner id, else by name (runner name = VM
        name)."""
        if vm.runner_id is not None:
            return self.by_id.get(vm.runner_id)
        return self.by_name.get(vm.name)


def classify(
    vm: VM, registration: RunnerView | None, running: bool = False, finished: bool = False
) -> VMState:
    """How ``vm`` counts, given its GitHub ``registration`` (None: absent or unknown) and
    whether a job record names its runner in progress (``running``) or done (``finished``).

    terminating: being deleted, phase Terminating, terminal, or its one job done; busy: a job
    recorded on the VM or in progress on its runner, or GitHub reports its runner busy; idle:
    its runner is online and not busy; starting: anything else (not yet online)."""
    if vm.deleting or vm.phase == VMPhase.TERMINATING or vm.is_terminal or finished:
        return VMState.TERMINATING
    if vm.has_job or running or (registration is not None and registration.busy):
        return VMState.BUSY
    if registration is not None and registration.online:
        return VMState.IDLE
    return VMState.STARTING


def recorded_runner(vm: VM) -> RunnerView | None:
    """The VM's runner as its status last recorded it (for a pass that cannot list them)."""
    r = vm.status.runner
    if r is None or (r.online is None and r.busy is None):
        return None
    return RunnerView(id=r.id or 0, name=vm.name, online=bool(r.online), busy=bool(r.busy))
