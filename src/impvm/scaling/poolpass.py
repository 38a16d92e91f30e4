"""One pool pass, decided: ``decide(world) -> PoolPlan``; and, once the plan was carried out,
``settle(world, plan, outcome) -> Settlement`` (status, conditions, Events, backoff, requeue).

Pure and deterministic: everything comes from the :class:`~impvm.scaling.world.PoolWorld`
(one clock reading, one jitter draw); nothing here does I/O. The sizing core is
:func:`impvm.scaling.pool.decide`; around it this module decides

* whether GitHub must be polled for jobs first (:class:`PollRequest`: the shell polls, then
  decides again on the world with the job table re-read);
* lost-node actions (like Kubernetes' node lifecycle controller: a VM on a node whose agent Lease
  expired is marked ``Failed``/``NodeLost``; one being deleted has the agent finalizer released);
* the VMs to create (:class:`NewVM`, made from the template; hash annotation for roll-outs),
  delete (deregistering first where the sizing says so), the JIT configs to mint and the
  registrations to remove, and whether GitHub may be called at all (backoff);
* the VM status records (runner and job, as GitHub and the job table say);
* the warm pool (:func:`warm_pool`): the events it folds into ``status.warmPool`` and the
  target that is the sizing's ``minIdle``;
* the whole pool status and its conditions, the GitHub-error -> condition mapping
  (:func:`github_condition`), the Events, the backoff and when to pass again.

Failure boundaries (Kubernetes API conventions: conditions say what is wrong; GitHub REST docs,
"Troubleshooting the REST API" and "Rate limits for the REST API" for the error classes):

- template or class missing, or the signing key a template requires unusable (``VerifyKeyMissing``:
  no VM is made, it would boot unverified images) -> ``TemplateMissing`` True, ``Ready`` False,
  pass again in 30 s;
- credentials Secret missing or incomplete -> ``CredentialsInvalid`` (``CredentialsError``);
- 401 -> ``CredentialsInvalid`` (``BadCredentials``); a permission not granted ->
  ``CredentialsInvalid`` (``PermissionNotGranted``);
- installation suspended or removed -> ``GitHubUnavailable`` (``InstallationUnavailable``);
- rate limit -> ``RateLimited`` (``PrimaryRateLimit``/``SecondaryRateLimit``, with the reset
  time), backoff until the reset; a low budget pauses polling (``BudgetLow``) but not minting;
- a request GitHub refused (other 4xx) -> only ``Ready`` says so (GitHub is not down);
- 5xx, timeouts -> ``GitHubUnavailable``; every GitHub failure backs off (full jitter) and a
  JIT config that was not minted leaves its VM without a Secret, retried after the backoff.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from impvm.api.conditions import ConditionSet
from impvm.api.models import (
    AGENT_FINALIZER,
    API_VERSION,
    DEMAND_ANNOTATION,
    JIT_SECRET_KEY,
    POOL_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    TERMINAL_PHASES,
    ScalingSpec,
    VMPhase,
    WarmPoolStatus,
)
from impvm.api.times import k8s_time
from impvm.scaling.names import owns_runner_name, secret_name, template_hash
from impvm.scaling.nodes import lost_nodes, node_lost, unschedulable
from impvm.scaling.pool import (
    Counts,
    PoolLimits,
    PoolSnapshot,
    ScalePlan,
    VMView,
    parse_demand,
)
from impvm.scaling.pool import decide as size
from impvm.scaling.runnerlist import fresh_wait
from impvm.scaling.warmpool import (
    JobQueued,
    RunnerReady,
    WarmPoolDecision,
    WarmPoolEvent,
    WarmPoolPolicy,
    WarmPoolState,
    warm_pool_target,
)
from impvm.scaling.world import (
    BackoffState,
    GitHubFailure,
    PollState,
    PoolObj,
    PoolWorld,
    VMObj,
    WarmPoolMemory,
)

__all__ = [
    "CONDITION_TYPES",
    "DeleteVM",
    "EventSpec",
    "FinalizerRelease",
    "Mint",
    "NewVM",
    "Outcome",
    "PollRequest",
    "PoolPlan",
    "RemoveRegistration",
    "Settlement",
    "VMStatusPatch",
    "current_template_hash",
    "decide",
    "github_condition",
    "jit_secret_manifest",
    "poll_since",
    "poll_wanted",
    "settle",
    "vm_manifest",
    "warm_policy",
    "warm_pool",
]

#: Condition types the pool pass owns (the reaper owns ``Reaper``).
CONDITION_TYPES = (
    "CredentialsInvalid",
    "GitHubUnavailable",
    "RateLimited",
    "Ready",
    "Unschedulable",
)
#: an unbound VM younger than this is not yet judged unschedulable: agents claim within a
#: second, and the used capacity on their Leases is up to one renewal (10 s) old
UNSCHEDULABLE_AFTER_SECONDS = 15.0


# --------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True, slots=True)
class EventSpec:
    """A core/v1 Event on the pool: reason (CamelCase), message (ours; no secret), type."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class PollRequest:
    """Poll GitHub for the scope's jobs now (``why``: a sentence), then decide again. ``since``
    (monotonic s): a poll of the installation that started then or later answers it (None: any
    poll since the operator started), so the pools of an installation share polls."""

    why: str
    since: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalizerRelease:
    """Remove the agent finalizer of VM ``name`` (its node is lost), guarded by
    ``resource_version``: ``finalizers`` is the list to write; ``event`` follows success."""

    name: str
    resource_version: str
    finalizers: tuple[str, ...]
    event: EventSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class VMStatusPatch:
    """Merge ``status`` into ImpVM ``name``'s status; ``event`` follows success, and so do the
    ``observe`` histogram observations (``(kind, seconds)``: ``jobPickup``,
    ``runnerRegistration``)."""

    name: str
    status: Mapping[str, Any]
    event: EventSpec | None = None
    observe: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteVM:
    """Delete ImpVM ``name``. With ``deregister`` the registration ``runner_id`` is deleted
    first; a busy runner (422) keeps its VM (``busy`` Event). With ``deregister_first`` the VM is
    deleted only after GitHub accepted (or when GitHub cannot be asked, never)."""

    name: str
    runner_id: int | None
    deregister: bool
    deregister_first: bool
    done: EventSpec
    busy: EventSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRegistration:
    """Delete registration ``runner_id`` (no VM has it); ``done`` follows success."""

    runner_id: int
    name: str
    done: EventSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Mint:
    """Give VM ``vm`` (uid ``vm_uid``) its JIT Secret ``secret``. ``record_only``: the Secret
    exists already (a crash before it was recorded), so only record its name. Else delete
    ``stale_runner_id`` first (a registration minted by a pass that crashed), mint, write the
    Secret, record it, then the runner id."""

    vm: str
    vm_uid: str
    secret: str
    stale_runner_id: int | None
    record_only: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class NewVM:
    """What each new VM is made of: its ``spec`` (wire form), labels and annotations. The shell
    names it (:func:`impvm.scaling.names.vm_name`) and makes the pool its controller."""

    spec: Mapping[str, Any]
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What carrying out a plan did: VMs created, the GitHub failure that stopped the acts
    (its ``vm`` set when a JIT mint failed), or the message of a JIT Secret write failure."""

    created: int = 0
    failure: GitHubFailure | None = None
    secret_write_failed: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Settlement:
    """The end of a pass: the pool status fields this controller owns (``status``), its
    conditions (``conditions``, to merge into what is stored), whether that differs from what is
    stored (``write``), the Events, the backoff and poll state to keep, the seconds until the next
    pass, the counts (with the VMs created) for metrics, and the warm pool's memory to keep once
    the status is written (None: the pass decided no warm pool)."""

    status: Mapping[str, Any]
    conditions: tuple[Mapping[str, Any], ...]
    write: bool
    events: tuple[EventSpec, ...] = ()
    backoff: BackoffState = field(default_factory=BackoffState)
    poll: PollState = field(default_factory=PollState)
    requeue: float = 10.0
    counts: Counts | None = None
    warm: WarmPoolMemory | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPlan:
    """What one pass does, in this order: ``releases`` and ``lost`` (lost nodes), ``deletions``,
    ``registrations``, ``mints``, ``create`` new VMs (each minted at once), then ``sync`` (VM
    runner/job records). ``use_github``: whether GitHub may be called for mints and creations.
    ``poll``: poll first and decide again (nothing else is in such a plan). ``settlement``: the
    end of the pass if every act succeeds (the shell settles again with the real outcome).
    ``warm``: the warm pool's decision (its target is ``sizing``'s minIdle) and the memory
    it leaves."""

    poll: PollRequest | None = None
    sizing: ScalePlan | None = None
    releases: tuple[FinalizerRelease, ...] = ()
    lost: tuple[VMStatusPatch, ...] = ()
    deletions: tuple[DeleteVM, ...] = ()
    registrations: tuple[RemoveRegistration, ...] = ()
    mints: tuple[Mint, ...] = ()
    create: int = 0
    new_vm: NewVM | None = None
    sync: tuple[VMStatusPatch, ...] = ()
    use_github: bool = False
    events: tuple[EventSpec, ...] = ()
    warm: tuple[WarmPoolDecision, WarmPoolMemory] | None = None
    settlement: Settlement | None = None

    @property
    def acts(self) -> int:
        """How many Kubernetes or GitHub writes the plan makes besides the status."""
        return (
            len(self.releases)
            + len(self.lost)
            + len(self.deletions)
            + len(self.registrations)
            + len(self.mints)
            + self.create
            + len(self.sync)
        )


# --------------------------------------------------------------------------------------------
# Pieces


def github_condition(failure: GitHubFailure) -> tuple[str, str, str] | None:
    """The condition ``(type, reason, message)`` a GitHub failure sets to True, or None when
    it sets none (GitHub refused one request: ``RequestRejected``; only ``Ready`` says so)."""
    kind, msg = failure.kind, failure.message
    if kind == "RequestRejected":
        return None
    if kind in ("CredentialsError", "BadCredentials", "PermissionNotGranted"):
        return ("CredentialsInvalid", kind, msg)
    if kind == "RateLimited":
        return ("RateLimited", f"{failure.rate_kind.capitalize()}RateLimit", msg)
    if kind == "InstallationUnavailable":
        text = f"the GitHub App installation is unavailable ({failure.unavailable_reason}): {msg}"
        return ("GitHubUnavailable", "InstallationUnavailable", text)
    return ("GitHubUnavailable", kind, msg)


def current_template_hash(world: PoolWorld) -> str | None:
    """The hash of what a new VM of the pool is made from (None without template or class)."""
    t, c = world.template, world.vm_class
    if t is None or c is None:
        return None
    spec = world.pool.spec
    return template_hash(
        image=t.spec.image,
        runner_layer=spec.runner_layer or t.spec.runner_layer,
        class_name=c.name,
        vcpu=c.spec.vcpu,
        memory_mib=c.spec.memory_mib,
        disk_gib=c.spec.disk_gib,
        expire_after=spec.expire_after or t.spec.expire_after,
        allow_unpinned=bool(spec.allow_unpinned_images or t.spec.allow_unpinned_images),
        network=spec.network.wire() if spec.network is not None else None,
        verify_key=world.verify_key.fingerprint if world.verify_key is not None else None,
    )


def _new_vm(world: PoolWorld, digest: str) -> NewVM:
    """A VM from the template: ephemeral, labelled, class and image copied; runnerLayer and
    expireAfter from the pool, else the template; the pool's egress policy copied (the class's
    applies too, see :mod:`impvm.agent.network`); the template's signing key as
    ``verify.publicKey`` (the agent verifies against the VM's own spec)."""
    assert world.template is not None
    t, pool = world.template.spec, world.pool.spec
    spec: dict[str, Any] = {"classRef": {"name": t.class_ref.name}, "image": t.image}
    spec["lifecycle"] = "ephemeral"
    if layer := pool.runner_layer or t.runner_layer:
        spec["runnerLayer"] = layer
    if pool.allow_unpinned_images or t.allow_unpinned_images:
        spec["allowUnpinnedImages"] = True
    if expire := pool.expire_after or t.expire_after:
        spec["expireAfter"] = expire
    if pool.network is not None:
        spec["network"] = pool.network.wire()
    if world.verify_key is not None:
        spec["verify"] = {"publicKey": world.verify_key.pem}
    return NewVM(
        spec=spec,
        labels={POOL_LABEL: world.pool.name},
        annotations={TEMPLATE_HASH_ANNOTATION: digest},
    )


def _controller(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def vm_manifest(pool: PoolObj, new: NewVM, name: str) -> dict[str, Any]:
    """The ImpVM ``name`` as ``new`` describes it, in the pool's namespace, controlled by the
    pool (the garbage collector removes it with the pool)."""
    meta: dict[str, Any] = {"name": name, "namespace": pool.namespace}
    meta |= {"labels": dict(new.labels), "annotations": dict(new.annotations)}
    meta["ownerReferences"] = [_controller("ImpVMRunnerPool", pool.name, pool.uid)]
    return {"apiVersion": API_VERSION, "kind": "ImpVM", "metadata": meta, "spec": dict(new.spec)}


def jit_secret_manifest(pool: PoolObj, mint: Mint, jit_config: str) -> dict[str, Any]:
    """The JIT Secret of VM ``mint.vm``: key ``jitconfig`` (base64), labelled for the pool,
    controlled by the VM (it goes with the VM). ``jit_config`` is secret: this dict goes to the
    API server and nowhere else."""
    meta: dict[str, Any] = {"name": mint.secret, "namespace": pool.namespace}
    meta["labels"] = {POOL_LABEL: pool.name}
    meta["ownerReferences"] = [_controller("ImpVM", mint.vm, mint.vm_uid)]
    value = base64.b64encode(jit_config.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {JIT_SECRET_KEY: value},
    }


def _github_usable(world: PoolWorld) -> bool:
    """GitHub answered this pass and may be called again now."""
    g = world.github
    polled_ok = world.polled is None or world.polled.failure is None
    return (
        g.connected
        and not g.skipped
        and g.failure is None
        and polled_ok
        and world.backoff.ready(world.mono)
    )


def _budget_low(world: PoolWorld) -> bool:
    b = world.github.budget
    floor = world.settings.poll_budget_floor
    return bool(b is not None and b.limit and b.remaining < floor * b.limit)


def poll_wanted(world: PoolWorld) -> str | None:
    """Why GitHub should be polled for jobs now, or None.

    Polls in polling/hybrid mode every ``polling.intervalSeconds`` (sooner when a runner became
    busy: a queued job was taken); in webhook mode once at start (an operator restart loses no
    job; every ``resync_seconds`` until the installation's poller read every repository once,
    as a large organisation takes several polls) and every ``webhook_safety_poll_seconds`` (a
    queued job whose later deliveries were lost must not keep a VM forever); never in manual
    mode, nor twice in one pass, nor while GitHub is failing. The rate-limit budget is not
    considered here (see :func:`decide`)."""
    scaling = world.pool.spec.scaling
    mode = scaling.mode if scaling else "manual"
    g = world.github
    if (
        mode == "manual"
        or world.polled is not None
        or g.runners is None
        or not _github_usable(world)
    ):
        return None
    polling = scaling.polling if scaling else None
    periodic = mode in ("polling", "hybrid") and polling is not None and polling.enabled
    last = world.poll.last_poll
    if last is None:
        return "first poll since the operator started"
    since = world.mono - last
    busy = frozenset(r.name for r in g.runners if r.busy)
    if periodic and polling is not None and since >= polling.interval_seconds:
        return f"{since:.0f}s since the last poll (interval {polling.interval_seconds}s)"
    if periodic and not busy <= world.poll.busy_at_poll:
        return "a runner became busy since the last poll"
    safety = world.settings.webhook_safety_poll_seconds
    if mode == "webhook" and since >= safety:
        return f"{since:.0f}s since the last poll (webhook-mode safety poll every {safety:.0f}s)"
    if mode == "webhook" and not world.poll.swept and since >= world.settings.resync_seconds:
        return "the first poll has not read every repository yet (start-up sweep)"
    return None


def poll_since(world: PoolWorld) -> float | None:
    """From when a poll answers the one :func:`poll_wanted` asks for (monotonic s): any poll
    since the start for the first; the moment it fell due for an interval or safety poll (a
    poll another pool of the installation started since then serves it too); now when a runner
    became busy (the queue changed now). Pure."""
    last = world.poll.last_poll
    if last is None:
        return None
    scaling = world.pool.spec.scaling
    polling = scaling.polling if scaling else None
    mode = scaling.mode if scaling else "manual"
    since = world.mono - last
    if mode in ("polling", "hybrid") and polling is not None and polling.enabled:
        if since >= polling.interval_seconds:
            return last + polling.interval_seconds
        return world.mono
    if not world.poll.swept:
        return min(world.mono, last + world.settings.resync_seconds)
    return min(world.mono, last + world.settings.webhook_safety_poll_seconds)


def _lost_nodes(
    world: PoolWorld,
) -> tuple[tuple[FinalizerRelease, ...], tuple[VMStatusPatch, ...]]:
    """Releases and status patches for the VMs bound to lost nodes."""
    bound = [vm for vm in world.vms if vm.spec.node_name]
    if not bound:
        return (), ()
    leases = list(world.leases)
    lost = lost_nodes(leases, world.now, world.settings.node_lost_grace_seconds)
    known = {lease.node for lease in leases}
    releases: list[FinalizerRelease] = []
    patches: list[VMStatusPatch] = []
    for vm in bound:
        node = vm.spec.node_name
        if not node_lost(node, known, lost):
            continue
        if vm.deleting:
            if AGENT_FINALIZER in vm.finalizers:
                releases.append(
                    FinalizerRelease(
                        name=vm.name,
                        resource_version=vm.resource_version,
                        finalizers=tuple(f for f in vm.finalizers if f != AGENT_FINALIZER),
                        event=EventSpec("NodeLost", f"{vm.name}: node {node} lost; VM released"),
                    )
                )
        elif vm.status.phase not in TERMINAL_PHASES:
            status = {
                "phase": VMPhase.FAILED.value,
                "exitReason": "NodeLost",
                "finishedAt": k8s_time(world.now),
                "message": f"the agent of node {node} stopped renewing its Lease",
            }
            event = EventSpec("NodeLost", f"{vm.name}: node {node} lost", warning=True)
            patches.append(VMStatusPatch(name=vm.name, status=status, event=event))
    return tuple(releases), tuple(patches)


def _view(vm: VMObj, world: PoolWorld, failed: set[str], digest: str) -> VMView:
    status = vm.status
    if vm.name in failed:
        status = status.model_copy(update={"phase": VMPhase.FAILED})
    return VMView.from_status(
        name=vm.name,
        created_at=vm.created_at,
        deleting=vm.deleting,
        has_secret=bool(vm.spec.runner_config_secret)
        and vm.spec.runner_config_secret in world.secrets,
        status=status,
        outdated=vm.made_from(world.vm_class) != digest,
    )


def _sync(world: PoolWorld, skip: set[str], minted: set[str]) -> tuple[VMStatusPatch, ...]:
    """Records to copy onto VMs: what GitHub says of each runner (an online runner whose
    registration vanished is offline), and the job each runner took (``in_progress`` carries
    ``runner_name``: job id, run id, repository, startedAt; ARC's jobId, workflowRunId,
    jobRepositoryName) — what the reaper reads."""
    out: list[VMStatusPatch] = []
    runners = world.github.runners
    by_name = {r.name: r for r in runners or ()}
    for vm in sorted(world.vms, key=lambda v: v.name):
        if vm.deleting or vm.name in skip or runners is None:
            continue
        recorded = vm.spec.runner_config_secret in world.secrets or vm.name in minted
        if not recorded:
            continue  # a registration the VM cannot use: the next mint replaces it
        cur = vm.status.runner
        have = (cur.id, cur.name, cur.online, cur.busy) if cur else None
        reg = by_name.get(vm.name)
        if reg is not None:
            if have != (reg.id, reg.name, reg.online, reg.busy):
                want = {"id": reg.id, "name": reg.name, "online": reg.online, "busy": reg.busy}
                patch: dict[str, Any] = {"runner": want}
                seen: tuple[tuple[str, float], ...] = ()
                timings = vm.status.timings
                if (reg.online or reg.busy) and (timings is None or not timings.runner_online_at):
                    patch["timings"] = {
                        "createdAt": k8s_time(vm.created_at),
                        "runnerOnlineAt": k8s_time(world.now),
                    }
                    took = max(0.0, (world.now - vm.created_at).total_seconds())
                    seen = (("runnerRegistration", took),)
                out.append(VMStatusPatch(name=vm.name, status=patch, observe=seen))
        elif cur is not None and cur.id is not None and (cur.online or cur.busy):
            gone = {"online": False, "busy": False}  # the registration vanished
            out.append(VMStatusPatch(name=vm.name, status={"runner": gone}))
    names = {vm.name: vm for vm in world.vms}
    for name, job in sorted(world.running_jobs.items()):
        target = names.get(name)
        if target is None or target.deleting or name in skip:
            continue
        if target.status.job is not None and target.status.job.id == job.id:
            continue
        record: dict[str, Any] = {
            "id": job.id,
            "workflowRunId": job.run_id,
            "repository": job.repository,
        }
        patch = {"job": record}
        seen = ()
        if job.started_at:
            record["startedAt"] = k8s_time(job.started_at)
            patch["timings"] = {
                "jobQueuedAt": k8s_time(min(job.seen_at, job.started_at)),
                "jobStartedAt": k8s_time(job.started_at),
            }
            if job.wait_seconds is not None:
                seen = (("jobPickup", job.wait_seconds),)
        out.append(VMStatusPatch(name=name, status=patch, observe=seen))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Warm pool

_TICK = dt.timedelta(microseconds=1)


def warm_policy(scaling: ScalingSpec | None) -> WarmPoolPolicy:
    """:meth:`WarmPoolPolicy.from_spec` of ``spec.scaling``. Raises ValueError naming the
    field (``spec.scaling`` itself when it is missing)."""
    if scaling is None:
        raise ValueError("spec.scaling is required")
    return WarmPoolPolicy.from_spec(scaling)


def _warm_state(world: PoolWorld) -> WarmPoolState:
    """The newer of ``status.warmPool`` and what the last pass wrote (a read of the pool can
    lag behind our own write)."""
    stored = WarmPoolState.from_status(world.pool.status.warm_pool)
    kept = world.warm.state
    if kept is None or kept.updated_at is None:
        return stored
    if stored.updated_at is None or kept.updated_at > stored.updated_at:
        return kept
    return stored


def warm_pool(world: PoolWorld, policy: WarmPoolPolicy) -> tuple[WarmPoolDecision, WarmPoolMemory]:
    """The warm pool of this pass: its decision (target, new state) and the memory to keep.

    Events (:mod:`impvm.scaling.warmpool`), each stamped after ``state.updated_at`` so it is
    folded in exactly once:

    - a :class:`JobQueued` per job-table arrival routed to the pool numbered above the memory's
      cursor, at its observation time (an arrival recorded after a later pass, as a poll's
      jobs are, at the instant after ``updated_at``);
    - a :class:`RunnerReady` per VM whose runner GitHub reports online (or busy) for the first
      time: its recorded runner never was and the memory has not counted it; ``seconds`` from
      the VM's creation to this pass, stamped ``now``.
    """
    state = _warm_state(world)
    since, now = state.updated_at, world.now

    def after(t: dt.datetime) -> dt.datetime:
        return t if since is None or t > since else since + _TICK

    mem = world.warm
    events: list[WarmPoolEvent] = [
        JobQueued(after(a.at)) for a in world.arrivals if a.seq > mem.cursor
    ]
    cursor = max([mem.cursor, world.arrivals_read, *(a.seq for a in world.arrivals)])
    names = {vm.name for vm in world.vms}
    ready = set(mem.ready & names)
    up = {r.name for r in world.github.runners or () if r.online or r.busy}
    for vm in sorted(world.vms, key=lambda v: v.name):
        cur = vm.status.runner
        if vm.name not in up or vm.name in ready:
            continue
        ready.add(vm.name)
        if cur is not None and (cur.online or cur.busy):
            continue  # counted before (by an earlier operator run)
        seconds = max(0.0, (now - vm.created_at).total_seconds())
        events.append(RunnerReady(after(now), seconds))
    decision = warm_pool_target(policy, state, events, now)
    return decision, WarmPoolMemory(cursor=cursor, state=decision.state, ready=frozenset(ready))


def _warm_status(decision: WarmPoolDecision) -> dict[str, Any]:
    """``status.warmPool`` as written: a field that is now unset is sent as null (a merge
    patch removes it)."""
    wire = decision.status().wire()
    wire.setdefault("activeSchedule", None)
    return wire


def _differs(stored: Mapping[str, Any], key: str, value: Any) -> bool:
    if key == "warmPool":  # compared as values: the API server may spell a time differently
        have = stored.get(key)
        return have is None or WarmPoolStatus.model_validate(have) != WarmPoolStatus.model_validate(
            value
        )
    return bool(stored.get(key) != value)


# --------------------------------------------------------------------------------------------
# Decide


def decide(world: PoolWorld) -> PoolPlan:
    """Decide one pass of ``world.pool`` (see the module docstring). Shape:
    ``PoolWorld -> PoolPlan``. A plan with ``poll`` set asks for a poll and nothing else."""
    if world.template is None or world.vm_class is None or world.verify_key_problem:
        return _finish(world, PoolPlan())
    try:
        limits = PoolLimits.from_spec(world.pool.spec)
        policy = warm_policy(world.pool.spec.scaling)
    except ValueError as e:
        return _finish(world, PoolPlan(events=(EventSpec("InvalidSpec", str(e), True),)))
    why = poll_wanted(world)
    if why is not None and not _budget_low(world):
        return PoolPlan(poll=PollRequest(why, poll_since(world)))

    events: list[EventSpec] = []
    try:
        demand = parse_demand(world.pool.annotations.get(DEMAND_ANNOTATION))
    except ValueError as e:
        events.append(EventSpec("InvalidDemand", f"{e}; treated as absent", warning=True))
        demand = None
    if world.webhook_secret_missing:
        text = f"Secret {world.webhook_secret_missing!r} not found"
        events.append(EventSpec("WebhookSecretMissing", text, warning=True))

    releases, lost = _lost_nodes(world)
    failed = {p.name for p in lost}
    digest = current_template_hash(world)
    assert digest is not None
    prefix = world.pool.prefix
    runners = world.github.runners
    warm = warm_pool(world, policy)
    limits = replace(limits, min_idle=warm[0].target)
    snapshot = PoolSnapshot(
        limits=limits,
        now=world.now,
        vms=tuple(_view(vm, world, failed, digest) for vm in world.vms),
        runners=None
        if runners is None
        else tuple(r for r in runners if owns_runner_name(prefix, r.name)),
        queued_jobs=world.pending_jobs,
        demand_annotation=demand,
        last_scale_up_time=world.pool.status.last_scale_up_time,
    )
    sizing = size(snapshot)
    can_call = world.github.connected and not world.github.skipped
    use_github = _github_usable(world)
    deletions = tuple(
        DeleteVM(
            name=d.name,
            runner_id=d.runner_id,
            deregister=can_call and d.runner_id is not None,
            deregister_first=d.deregister_first,
            done=EventSpec("VMDeleted", f"{d.name}: {d.message}"[:1000]),
            busy=EventSpec("ScaleDownSkipped", f"runner {d.name} is busy; VM kept"),
        )
        for d in sizing.delete_vms
    )
    registrations = tuple(
        RemoveRegistration(
            runner_id=r.runner_id, name=r.name, done=EventSpec("RegistrationRemoved", r.message)
        )
        for r in sizing.delete_registrations
        if can_call
    )
    uids = {vm.name: vm.uid for vm in world.vms}
    mints = tuple(
        Mint(
            vm=m.name,
            vm_uid=uids[m.name],
            secret=secret_name(m.name),
            stale_runner_id=m.stale_runner_id,
            record_only=secret_name(m.name) in world.secrets,
        )
        for m in sizing.mint_secrets
        if use_github or secret_name(m.name) in world.secrets
    )
    deleted = {d.name for d in deletions}
    plan = PoolPlan(
        sizing=sizing,
        releases=releases,
        lost=lost,
        deletions=deletions,
        registrations=registrations,
        mints=mints,
        create=sizing.create if use_github else 0,
        new_vm=_new_vm(world, digest),
        sync=_sync(world, deleted, {m.vm for m in mints if m.record_only}),
        use_github=use_github,
        events=tuple(events),
        warm=warm,
    )
    return _finish(world, plan)


def _finish(world: PoolWorld, plan: PoolPlan) -> PoolPlan:
    return replace(plan, settlement=settle(world, plan, Outcome(created=plan.create)))


# --------------------------------------------------------------------------------------------
# Settle


def _wait(backoff: BackoffState, mono: float) -> float:
    return max(0.0, backoff.not_before - mono)


def settle(world: PoolWorld, plan: PoolPlan, outcome: Outcome) -> Settlement:
    """The end of the pass once ``plan`` was carried out with ``outcome``: status, conditions,
    Events, backoff, poll state and requeue (see the module docstring). Pure."""
    pool = world.pool
    now, mono = world.now, world.mono
    conds = ConditionSet.from_status(pool.stored_status, pool.generation)
    events: list[EventSpec] = list(plan.events)
    status: dict[str, Any] = {"observedGeneration": pool.generation}

    if world.template is None or world.vm_class is None or world.verify_key_problem:
        tname, ns = pool.spec.template_name, pool.namespace
        if world.template is None:
            reason = "NotFound"
            msg = f"ImpVMTemplate {tname!r} not found in namespace {ns}; retrying in 30s"
        elif world.verify_key_problem:  # fail closed: a VM without its key would boot unverified
            reason = "VerifyKeyMissing"
            msg = f"ImpVMTemplate {tname!r}: {world.verify_key_problem}; retrying in 30s"
        else:
            reason = "ClassNotFound"
            cname = world.template.spec.class_ref.name
            msg = f"ImpVMClass {cname!r} (from template {tname!r}) not found; retrying in 30s"
        if conds.set("TemplateMissing", True, reason, msg, now):
            events.append(EventSpec("TemplateMissing", msg, warning=True))
        conds.set("Ready", False, "TemplateMissing", msg, now)
        return _settlement(
            world,
            status,
            conds,
            events,
            world.backoff,
            world.poll,
            world.settings.template_missing_requeue_seconds,
        )
    found = f"template {world.template.name} and class {world.vm_class.name}"
    conds.set("TemplateMissing", False, "Found", found, now)
    sizing = plan.sizing
    if sizing is None:  # the spec is invalid
        text = plan.events[0].message if plan.events else "invalid spec"
        conds.set("Ready", False, "InvalidSpec", text, now)
        return _settlement(
            world, status, conds, events, world.backoff, world.poll, world.settings.resync_seconds
        )

    backoff = world.backoff
    g = world.github
    ready_failure: tuple[str, str] | None = None
    if g.skipped:
        wait = _wait(backoff, mono)
        ready_failure = ("GitHubBackoff", f"{backoff.last_error}; retry in {wait:.0f}s")
    if g.runners is not None and g.failure is None:
        conds.set("CredentialsInvalid", False, "Valid", "credentials accepted by GitHub", now)
        conds.set("GitHubUnavailable", False, "Available", "GitHub answered", now)
        conds.set("RateLimited", False, "WithinLimits", "", now)

    poll = world.poll
    if poll_wanted(world) is not None and _budget_low(world):
        b = g.budget
        assert b is not None
        reset = dt.datetime.fromtimestamp(b.reset, dt.UTC)
        conds.set(
            "RateLimited",
            True,
            "BudgetLow",
            f"{b.remaining}/{b.limit} requests left until {k8s_time(reset)}; polling paused, "
            "JIT minting continues",
            now,
        )
        poll = PollState(mono, poll.busy_at_poll)  # try again next interval

    def failed(message: str, at_least: float = 0.0) -> BackoffState:
        s = world.settings
        return backoff.failed(
            mono,
            world.jitter,
            message=message,
            at_least=at_least,
            base=s.backoff_base_seconds,
            cap=s.backoff_cap_seconds,
        )

    failures = [f for f in (g.failure, world.polled and world.polled.failure, outcome.failure) if f]
    last_failure: GitHubFailure | None = None
    for f in failures:
        mapped = github_condition(f)
        said = mapped[2] if mapped else f.message  # what the Event and the backoff say
        before = backoff.last_error
        backoff = failed(said, f.retry_after if f.kind == "RateLimited" else 0.0)
        if mapped is None:
            changed = ready_failure is None
            ready_failure = ready_failure or ("GitHubRejected", f.message)
        else:
            ctype, reason, text = mapped
            if ctype == "RateLimited":
                reset = now + dt.timedelta(seconds=f.retry_after)
                text = f"{text}; resets {k8s_time(reset)}"
            changed = conds.set(ctype, True, reason, text, now)
        if changed or before != said:
            # a Secret lacking a key is a local problem, not an answer of GitHub's
            reason = "CredentialsInvalid" if f.kind == "CredentialsError" else "GitHubError"
            events.append(EventSpec(reason, said, warning=True))
        if f.vm is not None:
            delay = _wait(backoff, mono)
            ready_failure = (
                "JitMintFailed",
                f"JIT config for {f.vm} not minted ({f.kind}); retry in {delay:.0f}s",
            )
        last_failure = f
    kinds = {m[0] for f in failures if (m := github_condition(f)) is not None}
    if "RateLimited" in kinds and "GitHubUnavailable" not in kinds:
        # a rate-limit answer is an answer: an earlier 5xx or timeout no longer holds
        conds.set("GitHubUnavailable", False, "Available", "GitHub answered", now)
    if outcome.secret_write_failed:
        msg = outcome.secret_write_failed
        # each retry mints (and replaces) a registration: back off like a GitHub error
        backoff = failed(msg)
        ready_failure = ("SecretWriteFailed", msg)
        events.append(EventSpec("SecretWriteFailed", msg, warning=True))
    wants_github = sizing.create > 0 or any(
        secret_name(m.name) not in world.secrets for m in sizing.mint_secrets
    )
    if not plan.use_github and wants_github and ready_failure is None:
        wait = _wait(backoff, mono)
        ready_failure = ("GitHubBackoff", f"{backoff.last_error}; retry in {wait:.0f}s")
    if g.connected and not g.skipped and not failures and not outcome.secret_write_failed:
        backoff = backoff.succeeded()

    created = outcome.created
    c = replace(sizing.counts, starting=sizing.counts.starting + created)
    c = replace(c, total=c.total + created)  # with the VMs this pass made
    status.update(starting=c.starting, idle=c.idle, busy=c.busy, total=c.total)
    status.update(desired=c.desired, pendingJobs=c.pending, outdated=c.outdated)
    warm_memory = None
    if plan.warm is not None:
        decision, warm_memory = plan.warm
        status["warmPool"] = _warm_status(decision)
        was = pool.status.warm_pool.target if pool.status.warm_pool else None
        if was is not None and was != decision.target:
            text = f"warm pool target {was} -> {decision.target}: {decision.reason}"
            events.append(EventSpec("WarmPoolResized", text[:1000]))
    if created:
        status["lastScaleUpTime"] = k8s_time(now)
        events.append(
            EventSpec("ScaledUp", f"created {created} VM(s): {sizing.create_reason}"[:1000])
        )
    if world.timings is not None:
        # a merge patch keeps what it does not name: a kind gone from the window is nulled
        stored_timings = world.pool.stored_status.get("timings") or {}
        timings: dict[str, Any] = {k: None for k in stored_timings if k not in world.timings}
        status["timings"] = timings | dict(world.timings)
    if g.budget is not None:
        b = g.budget
        reset_at = k8s_time(dt.datetime.fromtimestamp(b.reset, dt.UTC))
        status["rateLimit"] = {"limit": b.limit, "remaining": b.remaining, "resetAt": reset_at}
    if world.polled is not None:
        p = world.polled
        if p.failure is not None:
            text = f"{p.failure.kind}: {p.failure.message}"[:500]
            status["lastPoll"] = {"time": k8s_time(p.time), "error": text}
        else:
            status["lastPoll"] = {
                "time": k8s_time(p.time),
                "queuedJobs": p.queued,
                "apiCalls": p.api_calls,
            }
    if ready_failure is not None:
        conds.set("Ready", False, *ready_failure, now)
    elif last_failure is not None:
        conds.set("Ready", False, last_failure.kind, last_failure.message, now)
    else:
        conds.set(
            "Ready",
            True,
            "Reconciled",
            f"{c.idle} idle, {c.busy} busy, {c.starting} starting; desired {c.desired}",
            now,
        )
    _placement(world, conds, events)
    s = world.settings
    # starting VMs are watched closely only while their runners are due: one stuck longer is
    # left to the bootstrap timeout (the runner list is not re-read for it either)
    starting = sizing.counts.starting > 0 and fresh_wait(world.vms, now, s)
    busy = sizing.create > created or starting or bool(sizing.mint_secrets)
    requeue = s.busy_resync_seconds if busy else s.resync_seconds
    if (due := _unschedulable_due(world)) is not None:  # the condition on time, not a resync late
        requeue = min(requeue, due)
    if not backoff.ready(mono):
        requeue = min(requeue, max(1.0, _wait(backoff, mono)))
    return _settlement(world, status, conds, events, backoff, poll, requeue, c, warm_memory)


def _unschedulable_due(world: PoolWorld) -> float | None:
    """Seconds until the next VM no agent claimed becomes :data:`UNSCHEDULABLE_AFTER_SECONDS`
    old (None: no such VM)."""
    now = world.now
    due = [
        UNSCHEDULABLE_AFTER_SECONDS - (now - v.created_at).total_seconds()
        for v in world.vms
        if not v.spec.node_name and not v.deleting and v.status.phase in (None, VMPhase.PENDING)
    ]
    waiting = [d for d in due if d > 0]
    return max(0.1, min(waiting)) if waiting else None


def waiting_for_a_node(world: PoolWorld) -> int:
    """The pool's VMs that no agent has claimed for :data:`UNSCHEDULABLE_AFTER_SECONDS`."""
    now = world.now
    return sum(
        1
        for v in world.vms
        if not v.spec.node_name
        and not v.deleting
        and v.status.phase in (None, VMPhase.PENDING)
        and (now - v.created_at).total_seconds() >= UNSCHEDULABLE_AFTER_SECONDS
    )


def _placement(world: PoolWorld, conds: ConditionSet, events: list[EventSpec]) -> None:
    """Condition ``Unschedulable``: True (with free and needed vCPU and MiB) while VMs of the
    pool fit on no live agent, with a Warning Event when it becomes True."""
    cls = world.vm_class
    if cls is None:
        return
    waiting = waiting_for_a_node(world)
    verdict = unschedulable(
        list(world.leases), world.now, waiting, cls.spec.vcpu, cls.spec.memory_mib
    )
    if verdict is None:
        text = f"{waiting} VM(s) waiting for a node" if waiting else "every VM is on a node"
        conds.set("Unschedulable", False, "Schedulable", text, world.now)
        return
    if conds.set("Unschedulable", True, verdict.reason, verdict.message, world.now):
        events.append(EventSpec("Unschedulable", verdict.message, warning=True))


def _settlement(
    world: PoolWorld,
    status: dict[str, Any],
    conds: ConditionSet,
    events: list[EventSpec],
    backoff: BackoffState,
    poll: PollState,
    requeue: float,
    counts: Counts | None = None,
    warm: WarmPoolMemory | None = None,
) -> Settlement:
    stored = world.pool.stored_status
    stored_conds = list(stored.get("conditions") or [])
    write = (
        # lastPoll and rateLimit change every pass: written along with a real change
        any(
            _differs(stored, k, v)
            for k, v in status.items()
            if k not in ("lastPoll", "rateLimit", "timings")
        )
        or (status.get("timings") is not None and status["timings"] != stored.get("timings"))
        or conds.merged_into(stored_conds) != stored_conds
        or "lastPoll" in status
    )
    return Settlement(
        status=status,
        conditions=tuple(conds.ours()),
        write=write,
        events=tuple(events),
        backoff=backoff,
        poll=poll,
        requeue=requeue,
        counts=counts,
        warm=warm,
    )
