"""What one pool pass observed: typed, frozen views of the Kubernetes objects and GitHub answers
the pure decision (:mod:`impvm.scaling.poolpass`) reads. Pure: parsing only, no I/O.

The observer (:mod:`impvm.operator.pool`) fills a :class:`PoolWorld` from its sources (today API
reads; a watch cache or a per-installation runner list can replace any of them without touching
the decision). Wall time and monotonic seconds come from one clock reading each.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from impvm.api.models import (
    TEMPLATE_HASH_ANNOTATION,
    ImpVMClassSpec,
    ImpVMRunnerPoolSpec,
    ImpVMRunnerPoolStatus,
    ImpVMSpec,
    ImpVMStatus,
    ImpVMTemplateSpec,
    PoolKey,
)
from impvm.scaling.jobtable import Arrival, Job
from impvm.scaling.names import runner_prefix, template_hash
from impvm.scaling.nodes import NodeLease
from impvm.scaling.pool import RunnerView
from impvm.scaling.warmpool import WarmPoolState

__all__ = [
    "BackoffState",
    "ClassObj",
    "GitHubFailure",
    "GitHubView",
    "PassSettings",
    "PollOutcome",
    "PollState",
    "PoolObj",
    "PoolWorld",
    "RateBudget",
    "TemplateObj",
    "VMObj",
    "WarmPoolMemory",
    "parse_time",
]


def parse_time(raw: str | None) -> dt.datetime | None:
    """A Kubernetes timestamp (``2026-11-30T12:00:00Z``) as an aware datetime; None stays."""
    if not raw:
        return None
    return dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))


# --------------------------------------------------------------------------------------------
# Kubernetes objects


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolObj:
    """An ImpVMRunnerPool as read: identity, parsed spec and status, and the stored ``status``
    (to tell whether a write would change anything)."""

    namespace: str
    name: str
    uid: str
    generation: int
    spec: ImpVMRunnerPoolSpec
    status: ImpVMRunnerPoolStatus
    stored_status: Mapping[str, Any] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    deleting: bool = False

    @property
    def key(self) -> PoolKey:
        return PoolKey(self.namespace, self.name)

    @property
    def prefix(self) -> str:
        """Name prefix of the pool's VMs and runners (:func:`impvm.scaling.names.runner_prefix`)."""
        return runner_prefix(self.name, self.uid)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolObj:
        """Parse a pool as the API server returns it (validated by the CRD schema)."""
        meta = body["metadata"]
        stored = body.get("status") or {}
        return cls(
            namespace=str(meta["namespace"]),
            name=str(meta["name"]),
            uid=str(meta["uid"]),
            generation=int(meta.get("generation") or 0),
            spec=ImpVMRunnerPoolSpec.model_validate(body["spec"]),
            status=ImpVMRunnerPoolStatus.model_validate(stored),
            stored_status=stored,
            annotations=dict(meta.get("annotations") or {}),
            deleting=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateObj:
    """An ImpVMTemplate: name and spec."""

    name: str
    spec: ImpVMTemplateSpec

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> TemplateObj:
        return cls(
            name=str(body["metadata"]["name"]),
            spec=ImpVMTemplateSpec.model_validate(body["spec"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyKey:
    """The public key a template's VMs must be signed by (``spec.verify``): ``pem`` as the
    template's Secret holds it, ``fingerprint`` ``sha256:<hex>`` of its DER form."""

    pem: str
    fingerprint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassObj:
    """An ImpVMClass: name and size."""

    name: str
    spec: ImpVMClassSpec

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ClassObj:
        return cls(
            name=str(body["metadata"]["name"]), spec=ImpVMClassSpec.model_validate(body["spec"])
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class VMObj:
    """An ImpVM of the pool: identity, metadata facts, parsed spec and status."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    created_at: dt.datetime
    spec: ImpVMSpec
    status: ImpVMStatus = field(default_factory=ImpVMStatus)
    deleting: bool = False
    finalizers: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner_uids: frozenset[str] = frozenset()

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> VMObj:
        """Parse an ImpVM as the API server returns it."""
        meta = body["metadata"]
        created = parse_time(meta.get("creationTimestamp"))
        return cls(
            namespace=str(meta["namespace"]),
            name=str(meta["name"]),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            created_at=created or dt.datetime.fromtimestamp(0, dt.UTC),
            spec=ImpVMSpec.model_validate(body["spec"]),
            status=ImpVMStatus.model_validate(body.get("status") or {}),
            deleting=bool(meta.get("deletionTimestamp")),
            finalizers=tuple(meta.get("finalizers") or ()),
            annotations=dict(meta.get("annotations") or {}),
            owner_uids=frozenset(
                str(r["uid"]) for r in meta.get("ownerReferences") or () if r.get("uid")
            ),
        )

    def made_from(self, vm_class: ClassObj | None) -> str:
        """The template hash of this VM: its annotation, else computed from its spec (a VM made
        before the annotation existed) with ``vm_class``'s size."""
        recorded = self.annotations.get(TEMPLATE_HASH_ANNOTATION)
        if recorded:
            return recorded
        size = vm_class.spec if vm_class and vm_class.name == self.spec.class_ref.name else None
        return template_hash(
            image=self.spec.image,
            runner_layer=self.spec.runner_layer,
            class_name=self.spec.class_ref.name,
            vcpu=size.vcpu if size else None,
            memory_mib=size.memory_mib if size else None,
            disk_gib=size.disk_gib if size else None,
            expire_after=self.spec.expire_after,
            allow_unpinned=bool(self.spec.allow_unpinned_images),
        )


# --------------------------------------------------------------------------------------------
# GitHub


@dataclass(frozen=True, slots=True, kw_only=True)
class GitHubFailure:
    """A GitHub (or credentials) error as the decision needs it; never holds a secret.

    ``kind`` is the error class name (:mod:`impvm.github.errors`: ``CredentialsError``,
    ``BadCredentials``, ``InstallationUnavailable``, ``PermissionNotGranted``, ``RateLimited``,
    ``RequestRejected``, ``TransientError``, ...); ``message`` its redacted text;
    ``retry_after`` the seconds a rate limit asks to wait; ``rate_kind`` ``primary`` or
    ``secondary``; ``unavailable_reason`` ``suspended`` or ``removed``; ``vm`` the VM whose JIT
    config was being minted, when that failed."""

    kind: str
    message: str
    retry_after: float = 0.0
    rate_kind: str = ""
    unavailable_reason: str = ""
    vm: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RateBudget:
    """The core rate-limit budget as the last response reported it (``reset``: epoch s)."""

    limit: int
    remaining: int
    reset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GitHubView:
    """What GitHub said this pass.

    - ``connected``: credentials were read and a client exists;
    - ``skipped``: the pool is in backoff, so no call was made;
    - ``runners``: the pool's registrations (already restricted to its names), None if unknown;
    - ``failure``: the credentials or listing error of this pass;
    - ``budget``: the rate-limit budget, if known.
    """

    connected: bool = False
    skipped: bool = False
    runners: tuple[RunnerView, ...] | None = None
    failure: GitHubFailure | None = None
    budget: RateBudget | None = None


@dataclass(frozen=True, slots=True)
class BackoffState:
    """Exponential backoff with full jitter of a pool's GitHub work. ``not_before`` is
    monotonic seconds; ``last_error`` the message of the last failure."""

    failures: int = 0
    not_before: float = 0.0
    last_error: str = ""

    def ready(self, mono: float) -> bool:
        """Whether GitHub may be called at ``mono``."""
        return mono >= self.not_before

    def failed(
        self,
        mono: float,
        jitter: float,
        *,
        message: str,
        at_least: float = 0.0,
        base: float = 2.0,
        cap: float = 300.0,
    ) -> BackoffState:
        """After a failure at ``mono``: the next try waits ``min(cap, base * 2**(n-1))`` times
        ``0.5 + jitter / 2`` (``jitter`` in [0, 1)), and at least ``at_least`` seconds (a rate
        limit's reset)."""
        n = self.failures + 1
        delay = min(cap, base * 2 ** (n - 1)) * (0.5 + jitter / 2)
        return BackoffState(n, mono + max(at_least, delay), message)

    def succeeded(self) -> BackoffState:
        return BackoffState(0, 0.0, self.last_error)


# --------------------------------------------------------------------------------------------
# Demand


@dataclass(frozen=True, slots=True)
class PollState:
    """When the poll that last answered the pool started (monotonic s; None: never) and which
    of its runners were busy then (a change means a queued job was taken: poll again)."""

    last_poll: float | None = None
    busy_at_poll: frozenset[str] = frozenset()
    #: whether every repository of the installation had been read once by then (a large
    #: organisation is read over several polls, within the installation's budget)
    swept: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PollOutcome:
    """The poll that answered this pass (the installation's, shared by its pools): when it
    finished, what it saw and cost, or why it failed; ``started``: when it started (monotonic
    s; None: this pass's reading), which becomes the pool's ``PollState.last_poll``, so pools
    served by one poll fall due together and share the next one too; ``swept``: every
    repository of the installation had been read once when it finished."""

    time: dt.datetime
    queued: int = 0
    api_calls: int = 0
    failure: GitHubFailure | None = None
    started: float | None = None
    swept: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PassSettings:
    """Operator tunables the decision reads (seconds; ``poll_budget_floor`` is a share)."""

    resync_seconds: float = 10.0
    busy_resync_seconds: float = 2.0
    template_missing_requeue_seconds: float = 30.0
    poll_budget_floor: float = 0.2
    webhook_safety_poll_seconds: float = 300.0
    node_lost_grace_seconds: float = 60.0
    backoff_base_seconds: float = 2.0
    backoff_cap_seconds: float = 300.0
    #: the oldest runner list a pool decides from with and without a VM awaiting its runner,
    #: and how long a new VM counts as awaiting it (:mod:`impvm.scaling.runnerlist`)
    awaiting_runner_list_seconds: float = 0.5
    idle_runner_list_seconds: float = 60.0
    runner_wait_fresh_seconds: float = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmPoolMemory:
    """What the warm pool keeps in memory between passes (all re-derivable: a restarted
    operator starts from ``status.warmPool`` and the VMs' recorded runners).

    - ``cursor``: job-table arrivals numbered up to it were folded in (never twice);
    - ``state``: the state the last pass wrote (used when a read of the pool lags behind it);
    - ``ready``: VMs whose runner was already counted ready (while their recorded runner
      still says otherwise).
    """

    cursor: int = 0
    state: WarmPoolState | None = None
    ready: frozenset[str] = frozenset()


# --------------------------------------------------------------------------------------------
# The world


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolWorld:
    """Everything one pass of pool ``pool`` decides from.

    - ``now`` / ``mono``: one clock reading (wall, monotonic seconds); ``jitter`` in [0, 1)
      for the backoff;
    - ``template`` / ``vm_class``: None when not found (then nothing else was observed);
    - ``verify_key``: the template's signing key (None: it requires no signatures);
      ``verify_key_problem``: why a key the template requires cannot be used (then nothing
      else was observed and no VM is made);
    - ``vms``: the ImpVMs the pool owns; ``secrets``: names of the pool's JIT Secrets;
    - ``leases``: every agent Lease; ``github``: :class:`GitHubView`;
    - ``backoff``, ``poll``: state carried between passes (in memory);
    - ``pending_jobs``: queued jobs routed to the pool; ``running_jobs``: in-progress jobs by
      runner name; ``polled``: this pass's poll, when one ran;
    - ``webhook_secret_missing``: the webhook Secret's name when it is missing;
    - ``arrivals``: the job-table arrivals routed to the pool numbered above ``warm.cursor``,
      read when the table's latest was ``arrivals_read``; ``warm``: :class:`WarmPoolMemory`.
    """

    pool: PoolObj
    now: dt.datetime
    mono: float
    jitter: float = 0.5
    settings: PassSettings = field(default_factory=PassSettings)
    template: TemplateObj | None = None
    vm_class: ClassObj | None = None
    verify_key: VerifyKey | None = None
    verify_key_problem: str | None = None
    vms: tuple[VMObj, ...] = ()
    secrets: frozenset[str] = frozenset()
    leases: tuple[NodeLease, ...] = ()
    github: GitHubView = field(default_factory=GitHubView)
    backoff: BackoffState = field(default_factory=BackoffState)
    poll: PollState = field(default_factory=PollState)
    pending_jobs: int = 0
    running_jobs: Mapping[str, Job] = field(default_factory=dict)
    polled: PollOutcome | None = None
    webhook_secret_missing: str | None = None
    #: the pool's ``status.timings`` to publish (:func:`impvm.scaling.timings.summary`)
    timings: Mapping[str, Any] | None = None
    arrivals: tuple[Arrival, ...] = ()
    arrivals_read: int = 0
    warm: WarmPoolMemory = field(default_factory=WarmPoolMemory)

    def after_poll(
        self, outcome: PollOutcome, pending_jobs: int, running_jobs: Mapping[str, Job]
    ) -> PoolWorld:
        """This world once the poll it asked for ran (the job table's view re-read)."""
        busy = frozenset(r.name for r in self.github.runners or () if r.busy)
        at = self.mono if outcome.started is None else outcome.started
        return replace(
            self,
            polled=outcome,
            poll=PollState(at, busy, outcome.swept),
            pending_jobs=pending_jobs,
            running_jobs=running_jobs,
        )
