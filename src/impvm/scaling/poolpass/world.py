"""What one pool pass observed: typed, frozen views of the Kubernetes objects and GitHub answers
the pure pass reads, and the memory it carries from the last pass. Pure: parsing only, no I/O.

The observer (:mod:`impvm.operator.observe`) fills a :class:`PoolWorld` from its sources (watch
caches, the shared runner directory, the job table); wall time and monotonic seconds come from
one clock reading each. ImpVMs are :class:`impvm.api.vm.VM`, the one VM read model.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from impvm.api.models import (
    ImpVMClassSpec,
    ImpVMRunnerPoolSpec,
    ImpVMRunnerPoolStatus,
    ImpVMTemplateSpec,
    PoolKey,
)
from impvm.api.times import parse_time
from impvm.api.vm import VM
from impvm.scaling.jobs import Arrival, Job
from impvm.scaling.names import runner_prefix
from impvm.scaling.nodes import NodeLease
from impvm.scaling.poolpass.answers import (
    FailureKind,
    GitHubFailure,
    GitHubView,
    PollOutcome,
    RateBudget,
    RunnerView,
)
from impvm.scaling.poolpass.memory import PollState, PoolMemory, PoolRoute
from impvm.scaling.settings import PassSettings

__all__ = [
    "ClassObj",
    "FailureKind",
    "GitHubFailure",
    "GitHubView",
    "PollOutcome",
    "PoolObj",
    "PoolWorld",
    "RateBudget",
    "RunnerView",
    "TemplateObj",
    "VerifyKey",
]


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
    #: ``metadata.creationTimestamp`` in epoch seconds (0: absent): the oldest pool wins
    #: routing ties
    created: float = 0.0

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
            created=_epoch(meta.get("creationTimestamp")),
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


# --------------------------------------------------------------------------------------------
# The world


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolWorld:
    """Everything one pass of pool ``pool`` decides from.

    - ``now`` / ``mono``: one clock reading (wall, monotonic seconds); ``jitter`` in [0, 1)
      for the backoff; ``settings``: the operator's :class:`PassSettings` (the one object);
    - ``template`` / ``vm_class``: None when not found (then nothing else was observed);
    - ``verify_key``: the template's signing key (None: it requires no signatures);
      ``verify_key_problem``: why a key the template requires cannot be used (then nothing
      else was observed and no VM is made);
    - ``vms``: the ImpVMs the pool owns; ``secrets``: names of the pool's JIT Secrets;
    - ``leases``: every agent Lease; ``github``: :class:`GitHubView`;
    - ``pending_jobs``: queued jobs routed to the pool; ``running_jobs``: in-progress jobs by
      runner name; ``finished_jobs``: jobs that completed on a runner of the pool, by runner
      name (a job's record is evidence of what its runner did: GitHub's runner list lags);
      ``polled``: this pass's poll, when one ran;
    - ``webhook_secret_missing``: the webhook Secret's name when it is missing;
    - ``class_denied``: why the pool's namespace may not use its class (the class's
      ``spec.namespaces``); the pool then makes no VM and lets the ones it has finish;
    - ``route``: the pool as job routing and wake-ups know it, as observed this pass;
    - ``arrivals``: the job-table arrivals routed to the pool numbered above the warm pool's
      cursor, read when the table's latest was ``arrivals_read``;
    - ``memory``: what the last pass concluded (:class:`PoolMemory`).
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
    vms: tuple[VM, ...] = ()
    secrets: frozenset[str] = frozenset()
    leases: tuple[NodeLease, ...] = ()
    github: GitHubView = field(default_factory=GitHubView)
    pending_jobs: int = 0
    running_jobs: Mapping[str, Job] = field(default_factory=dict)
    finished_jobs: Mapping[str, Job] = field(default_factory=dict)
    polled: PollOutcome | None = None
    webhook_secret_missing: str | None = None
    class_denied: str | None = None
    route: PoolRoute | None = None
    arrivals: tuple[Arrival, ...] = ()
    arrivals_read: int = 0
    memory: PoolMemory = field(default_factory=PoolMemory)

    @property
    def found(self) -> bool:
        """Template, class and (when required) signing key are usable: VMs can be made."""
        return (
            self.template is not None and self.vm_class is not None and not self.verify_key_problem
        )

    def job_on(self, runner: str) -> Job | None:
        """The job record naming ``runner``: in progress, else completed (None: none known)."""
        return self.running_jobs.get(runner) or self.finished_jobs.get(runner)

    def after_poll(
        self, outcome: PollOutcome, jobs: PoolWorld, vanished: frozenset[str] = frozenset()
    ) -> PoolWorld:
        """This world once the poll it asked for ran: ``jobs`` is the world with the job
        table's view read again; ``vanished``: the runners whose vanished registration the
        poll was asked for."""
        busy = frozenset(r.name for r in self.github.runners or () if r.busy)
        at = self.mono if outcome.started is None else outcome.started
        poll = PollState(at, busy, outcome.swept, vanished)
        return replace(
            self,
            polled=outcome,
            memory=replace(self.memory, poll=poll),
            pending_jobs=jobs.pending_jobs,
            running_jobs=jobs.running_jobs,
            finished_jobs=jobs.finished_jobs,
            arrivals=jobs.arrivals,
            arrivals_read=jobs.arrivals_read,
        )


def _epoch(stamp: object) -> float:
    """A ``metadata`` timestamp in epoch seconds (0 when absent; the API server writes
    RFC 3339, so anything else raises ValueError like :func:`~impvm.api.times.parse_time`)."""
    when = parse_time(stamp)
    return when.timestamp() if when is not None else 0.0
