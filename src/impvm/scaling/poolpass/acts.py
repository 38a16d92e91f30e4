"""The terms of a pool pass: what it asks first (:class:`PollRequest`), the acts it decides
(:class:`PoolActs`, each act a small frozen value), what carrying them out did
(:class:`ActsDone`) and how the pass ends (:class:`PassConclusion`). Pure data; the
executor (:mod:`impvm.operator.execute`) carries acts out in the order :class:`PoolActs` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from impvm.api.models import ImpVMRunnerPoolStatus, ImpVMStatus
from impvm.scaling.poolpass.memory import PoolMemory, StartFailures, WarmPoolMemory
from impvm.scaling.poolpass.sizing import Counts, Sizing
from impvm.scaling.poolpass.world import GitHubFailure
from impvm.scaling.warmpool import WarmPoolDecision

__all__ = [
    "ActsDone",
    "DeleteVM",
    "Deleted",
    "Deregistration",
    "EventSpec",
    "MintJit",
    "PassConclusion",
    "PatchVMStatus",
    "PollRequest",
    "PoolActs",
    "ReleaseFinalizer",
    "RemoveRegistration",
    "Why",
]


@dataclass(frozen=True, slots=True)
class EventSpec:
    """A core/v1 Event on the pool: reason (CamelCase), message (ours; no secret), type."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class PollRequest:
    """The first phase of a pass: poll GitHub for the scope's jobs before deciding (``why``: a
    sentence). ``since`` (monotonic s): a poll of the installation that started then or later
    answers it (None: any poll since the operator started), so the pools of an installation
    share polls; ``vanished``: runners whose registration vanished without a job record (the
    poll may find the job they ran)."""

    why: str
    since: float | None = None
    vanished: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseFinalizer:
    """Remove the agent finalizer of VM ``name`` (its node is lost), guarded by
    ``resource_version``: ``finalizers`` is the list to write; ``event`` follows success."""

    name: str
    resource_version: str
    finalizers: tuple[str, ...]
    event: EventSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class PatchVMStatus:
    """Merge ``status`` (a typed patch: only the fields it sets) into ImpVM ``name``'s status;
    ``event`` follows success, and so do the ``observe`` histogram observations (``(kind,
    seconds)``: ``jobPickup``, ``runnerRegistration``)."""

    name: str
    status: ImpVMStatus
    event: EventSpec | None = None
    observe: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteVM:
    """Delete ImpVM ``name``; with ``deregister`` its registration ``runner_id`` first.

    ``keep_if_busy``: a runner GitHub says is busy (422) keeps its VM (the pool's scale-down:
    it took a job); else the VM goes anyway (the reaper: GitHub releases a hung job's runner
    once the VM is gone). ``deregister_first``: the VM goes only after GitHub accepted the
    deregistration (and stays when GitHub cannot be asked)."""

    name: str
    runner_id: int | None
    deregister: bool
    deregister_first: bool = False
    keep_if_busy: bool = True
    why: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRegistration:
    """Delete registration ``runner_id`` (no VM has it); ``done`` follows success."""

    runner_id: int
    name: str
    done: EventSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class MintJit:
    """Give VM ``vm`` (uid ``vm_uid``) its JIT Secret ``secret``. ``record_only``: the Secret
    exists already (a crash before it was recorded), so only record its name. Else delete
    ``stale_runner_id`` first (a registration minted by a pass that crashed), mint, write the
    Secret, record it, then the runner id."""

    vm: str
    vm_uid: str
    secret: str
    stale_runner_id: int | None
    record_only: bool


class Why(StrEnum):
    """Which rung of the pass's ladder decided (:func:`impvm.scaling.poolpass.pool_acts`)."""

    TEMPLATE_MISSING = "template-missing"
    INVALID_SPEC = "invalid-spec"
    ACTS = "acts"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolActs:
    """What one pass does, in this order: ``releases`` and ``lost`` (lost nodes),
    ``deletions``, ``registrations``, ``mints``, ``create`` new VMs made from ``made_from``
    (the template hash; each minted at once), then ``records`` (VM runner and job records).
    ``use_github``: whether GitHub may be called for mints and creations. ``sizing``: the
    sizing they come from; ``warm``: the warm pool's decision (its target is the sizing's
    minIdle) and the memory it leaves; ``events``: Events decided before acting."""

    why: Why = Why.ACTS
    sizing: Sizing | None = None
    releases: tuple[ReleaseFinalizer, ...] = ()
    lost: tuple[PatchVMStatus, ...] = ()
    deletions: tuple[DeleteVM, ...] = ()
    registrations: tuple[RemoveRegistration, ...] = ()
    mints: tuple[MintJit, ...] = ()
    create: int = 0
    made_from: str = ""
    records: tuple[PatchVMStatus, ...] = ()
    use_github: bool = False
    events: tuple[EventSpec, ...] = ()
    warm: tuple[WarmPoolDecision, WarmPoolMemory] | None = None
    #: the template's start failures in a row (:mod:`impvm.scaling.poolpass.starts`)
    starts: StartFailures | None = None
    #: what the start-failure backoff or the JIT mint budget held back, if anything
    held_back: str = ""

    @property
    def count(self) -> int:
        """How many Kubernetes or GitHub writes the acts make besides the status."""
        return (
            len(self.releases)
            + len(self.lost)
            + len(self.deletions)
            + len(self.registrations)
            + len(self.mints)
            + self.create
            + len(self.records)
        )


class Deregistration(StrEnum):
    """GitHub's answer to a runner's deregistration (``failed``: it could not be asked)."""

    DELETED = "deleted"
    BUSY = "busy"
    NOT_FOUND = "not_found"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Deleted:
    """What became of one :class:`DeleteVM`: ``deregistration`` (None when not attempted) and
    whether the VM is gone (``gone``; ``missing``: it was gone already, 404; ``refused``: the
    API server refused the deletion)."""

    name: str
    deregistration: Deregistration | None = None
    gone: bool = False
    missing: bool = False
    refused: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ActsDone:
    """What carrying the acts out did: VMs created, each deletion's result, the GitHub failure
    that stopped the acts (its ``vm`` set when a JIT mint failed), or the message of a JIT Secret
    write failure; ``interrupted``: an unexpected error ended the acts (they are retried)."""

    created: int = 0
    deleted: tuple[Deleted, ...] = ()
    failure: GitHubFailure | None = None
    secret_write_failed: str | None = None
    interrupted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PassConclusion:
    """The end of a pass: the pool status fields this controller owns (``status``: a typed
    patch), its conditions (``conditions``, to merge into what is stored), whether that
    differs from what is stored (``write``), the Events, the memory to keep, the seconds until
    the next pass, and the counts (with the VMs created) for metrics."""

    status: ImpVMRunnerPoolStatus
    conditions: tuple[dict[str, object], ...]
    write: bool
    events: tuple[EventSpec, ...] = ()
    memory: PoolMemory = field(default_factory=PoolMemory)
    requeue: float = 10.0
    counts: Counts | None = None
