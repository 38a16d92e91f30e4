"""The reaper's imperative shell: one pass per pool over the VMs whose runner may have outlived
its job, judged by the pure table in :mod:`impvm.reaper`.

A pass (:func:`reap_pool`) for a pool with ``spec.reaper.enabled``:

1. lists the pool's ImpVMs (label ``imp.dev/runner-pool=<pool>``, controlled by the pool);
2. asks :func:`impvm.reaper.needs_lookup` which of them need GitHub: idle VMs, VMs being deleted
   and malformed job records are decided without any GitHub call;
3. reads, for each remaining VM, its workflow run (and, when the run is not completed and a job
   id is recorded, its job) with an installation token restricted to ``actions: read`` and
   nothing else (:data:`REAPER_PERMISSIONS`). The first read mints the token, once per pass
   (cached by the client for its lifetime, so later passes usually mint none); when it cannot
   be minted the pass reads nothing else, **deletes nothing** and reports the error;
4. judges each VM (:func:`impvm.reaper.judge`); a VM whose run or job could not be read is left
   alone and counted as not judged, the others are still judged;
5. deletes each VM judged ``delete``: its runner is deregistered first when a ``deregister``
   client is given and the runner id is known (a 422 "still running a job" does not stop the
   deletion: GitHub releases a hung job's runner once the VM is gone and the pool controller
   sweeps the offline registration), then the ImpVM is deleted (its agent stops the VM). With
   ``spec.reaper.dryRun`` it only logs "would delete" with the reason;
6. reports: every deletion is logged and recorded as an Event on the pool naming the run, the
   repository and the reason; the pool's ``Reaper`` condition says whether the last pass was
   complete (True) or why not (False: ``TokenRefused``, ``NotJudged``, ``ListFailed``,
   ``DeleteFailed``, ``CredentialsInvalid``), with a Warning Event when that changes.

A VM is only deleted on a positive answer from GitHub. No message,
log line or Event carries a secret: GitHub errors are redacted by :class:`GitHubClient` and ours
name keys and ids only.

Scheduling (:func:`reaper_loop`): one loop per pool (a kopf daemon), a pass every
``spec.reaper.intervalSeconds`` (default 300 s), so passes of one pool never overlap; a
per-pool lock in this process also serialises direct calls of :func:`reap_pool` (held only while
a pass runs, so the locks of pools long gone take no memory). The loop gets its client from the
operator's :class:`~impvm.operator.credentials.GitHubProvider`: one token cache per
installation, shared with the pool controller.

Kubernetes permissions a pass needs in the pool's namespace (``deploy/rbac/reaper.yaml``):
list/watch/get/delete ImpVMs, get ImpVMRunnerPools, patch ``impvmrunnerpools/status``, get the
App Secret (by name), create Events.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType
from pydantic import ValidationError

from impvm.api.conditions import ConditionSet
from impvm.api.models import (
    API_VERSION,
    POOL_LABEL,
    ImpVM,
    ImpVMRunnerPool,
    PoolKey,
    ReaperSpec,
)
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.api.times import utcnow
from impvm.events import EventRecorder
from impvm.github import DeleteOutcome, GitHubClient, Scope
from impvm.github.errors import (
    BadCredentials,
    CredentialsError,
    GitHubError,
    InstallationUnavailable,
    PermissionNotGranted,
)
from impvm.operator.context import OperatorContext
from impvm.operator.metrics import REAPER_DECISIONS
from impvm.reaper import (
    Action,
    JobInfo,
    Lookup,
    ReapVM,
    RunInfo,
    Verdict,
    judge,
    lookup_failed,
    needs_lookup,
)

__all__ = [
    "CONDITION_TYPE",
    "REAPER_PERMISSIONS",
    "ReapOutcome",
    "ReapReport",
    "reap_pool",
    "reaper_enabled",
    "reaper_loop",
    "record_report",
]

log = logging.getLogger("impvm.operator.reaper")

#: The only permission of the installation token a pass mints (an ``actions: read``
#: installation token: least privilege for reading runs and jobs).
REAPER_PERMISSIONS: Final[Mapping[str, str]] = {"actions": "read"}
#: Type of the pool condition reporting the last pass.
CONDITION_TYPE: Final = "Reaper"
#: Templated endpoint of the token exchange (what a mint failure's ``endpoint`` says).
TOKEN_ENDPOINT: Final = "/app/installations/{installation_id}/access_tokens"
#: Reporting component of the reaper's Events.
COMPONENT: Final = "impvm-reaper"
#: Most GitHub reads in flight at once in one pass.
LOOKUP_CONCURRENCY: Final = 4
#: Seconds between passes when the pool has no ``spec.reaper`` (``ReaperSpec`` default).
DEFAULT_INTERVAL_SECONDS: Final = 300
#: Seconds before a pass that failed with an unexpected error is retried.
ERROR_RETRY_SECONDS: Final = 30.0

#: One lock per pool while a pass of it runs (weak: a lock nobody holds is forgotten).
_locks: weakref.WeakValueDictionary[PoolKey, asyncio.Lock] = weakref.WeakValueDictionary()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapOutcome:
    """What a pass did with one VM: ``verdict`` (action, table rule, reason sentence), the
    recorded ``run_id``/``repository``/``runner_id`` (None when not recorded), and for a
    deleted VM the deregistration outcome (``deleted``, ``busy``, ``not_found``, ``failed``;
    None when not attempted)."""

    vm: str
    verdict: Verdict
    run_id: int | None = None
    repository: str | None = None
    runner_id: int | None = None
    deregistration: str | None = None


@dataclass(slots=True, kw_only=True)
class ReapReport:
    """Result of one pass over pool ``namespace/pool``.

    - ``deleted``: VMs deleted; ``would_delete``: VMs a dry run would have deleted;
    - ``kept``: VMs judged to stay (idle, running within the bound, inside the grace, deleting);
    - ``unjudged``: VMs left alone because their record is malformed or GitHub could not be
      read for them (``not_judged`` is their count);
    - ``failed``: VMs judged ``delete`` whose deletion the API server refused;
    - ``error`` / ``error_reason``: why the pass as a whole did nothing (token not minted, VMs
      not listable, credentials unreadable); None when it ran;
    - ``skipped``: the pool's reaper is not enabled (nothing was read or written).
    """

    namespace: str
    pool: str
    dry_run: bool = False
    deleted: list[ReapOutcome] = field(default_factory=list)
    would_delete: list[ReapOutcome] = field(default_factory=list)
    kept: list[ReapOutcome] = field(default_factory=list)
    unjudged: list[ReapOutcome] = field(default_factory=list)
    failed: list[ReapOutcome] = field(default_factory=list)
    error: str | None = None
    error_reason: str | None = None
    skipped: bool = False

    @property
    def not_judged(self) -> int:
        """How many VMs were not judged."""
        return len(self.unjudged)

    @property
    def complete(self) -> bool:
        """Whether every VM was judged and every decision carried out."""
        return self.error is None and not self.unjudged and not self.failed

    def summary(self) -> str:
        """One sentence for the condition message and logs (no secrets)."""
        if self.error is not None:
            return self.error
        parts = [
            f"deleted {len(self.deleted)}",
            f"kept {len(self.kept)}",
            f"not judged {self.not_judged}",
        ]
        if self.dry_run:
            parts.insert(1, f"would delete {len(self.would_delete)} (dry run)")
        if self.failed:
            parts.append(f"deletion failed {len(self.failed)}")
        text = "last pass: " + ", ".join(parts)
        if self.unjudged:
            text += "; " + "; ".join(o.verdict.reason for o in self.unjudged[:3])
        if self.failed:
            text += "; " + "; ".join(o.verdict.reason for o in self.failed[:3])
        return text


class _TokenNotMinted(Exception):
    def __init__(self, error: GitHubError) -> None:
        super().__init__(str(error))
        self.error = error


def _as_dict(pool: Any) -> dict[str, Any]:
    if isinstance(pool, Mapping):
        return dict(pool)
    to_dict = getattr(pool, "to_dict", None)
    if callable(to_dict):
        out: dict[str, Any] = to_dict()
        return out
    raise TypeError(f"expected a pool object (dict or lightkube resource), got {type(pool)}")


def reaper_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf ``when`` filter: whether a pool's ``spec.reaper.enabled`` is true."""
    reaper = spec.get("reaper") or {}
    return bool(reaper.get("enabled"))


def _reaper_spec(raw: Mapping[str, Any]) -> ReaperSpec | None:
    return ImpVMRunnerPool.model_validate(raw).spec.reaper


# --------------------------------------------------------------------------------------------
# One pass


async def reap_pool(
    kube: AsyncClient,
    github: GitHubClient,
    pool: Any,
    now: dt.datetime,
    *,
    deregister: GitHubClient | None = None,
) -> ReapReport:
    """One reaper pass over ``pool`` (a dict as the API server returns it, or a lightkube
    resource with ``to_dict``): see the module docstring for the steps.

    ``github``: a client for the pool's credentials; the pass uses only its
    ``with_permissions({"actions": "read"})`` view. ``deregister``: optional client allowed to
    delete runners (``organization_self_hosted_runners: write`` or ``administration: write``);
    without it registrations are left to the pool controller's orphan sweep. ``now``: the
    pass's clock reading (timezone-aware). Thresholds come from ``spec.reaper`` (seconds).

    Returns the :class:`ReapReport` and records it on the pool (condition ``Reaper``, Events).
    A disabled reaper returns a report with ``skipped`` and touches nothing. Kubernetes errors
    other than those reported (listing, deleting) propagate as ``ApiError``; GitHub errors
    never propagate.
    """
    raw = _as_dict(pool)
    meta = raw["metadata"]
    ns, name = str(meta["namespace"]), str(meta["name"])
    spec = _reaper_spec(raw)
    if spec is None or not spec.enabled:
        return ReapReport(namespace=ns, pool=name, skipped=True)
    key = PoolKey(ns, name)
    lock = _locks.get(key)
    if lock is None:
        lock = _locks[key] = asyncio.Lock()
    async with lock:
        report = await _pass(kube, github, raw, spec, now, deregister)
        await record_report(kube, raw, report, now)
    for group in (report.deleted, report.would_delete, report.kept, report.unjudged, report.failed):
        for o in group:
            REAPER_DECISIONS.labels(ns, name, o.verdict.action, o.verdict.rule).inc()
    return report


async def _pass(
    kube: AsyncClient,
    github: GitHubClient,
    raw: dict[str, Any],
    spec: ReaperSpec,
    now: dt.datetime,
    deregister: GitHubClient | None,
) -> ReapReport:
    meta = raw["metadata"]
    ns, name, uid = str(meta["namespace"]), str(meta["name"]), str(meta["uid"])
    report = ReapReport(namespace=ns, pool=name, dry_run=spec.dry_run)

    # 1. the pool's VMs (only those it controls: never touch what this pool did not create)
    try:
        objs = [
            o.to_dict()
            async for o in kube.list(ImpVMResource, namespace=ns, labels={POOL_LABEL: name})
        ]
    except ApiError as e:
        report.error_reason = "ListFailed"
        report.error = f"listing the pool's ImpVMs failed (HTTP {e.status.code}); deleted nothing"
        return report
    vms = [o for o in objs if _controlled_by(o, uid)]

    # 2. decisions without GitHub
    pending: list[tuple[ReapVM, Lookup, int | None]] = []
    for o in vms:
        vm, runner_id = _reap_vm(o)
        first = needs_lookup(vm)
        if isinstance(first, Verdict):
            _file(report, ReapOutcome(vm=vm.name, verdict=first, runner_id=runner_id))
        else:
            pending.append((vm, first, runner_id))
    if not pending:
        return report

    # 3. GitHub reads, restricted to actions: read; the first one mints the token
    reader = github.with_permissions(REAPER_PERMISSIONS)
    results: list[tuple[RunInfo, JobInfo | None] | GitHubError] = []
    try:
        results.append(await _read(reader, pending[0][1], first=True))
    except _TokenNotMinted as e:
        refused = (PermissionNotGranted, BadCredentials, InstallationUnavailable)
        report.error_reason = "TokenRefused" if isinstance(e.error, refused) else "TokenUnavailable"
        report.error = _token_message(e.error)
        for vm, lookup, runner_id in pending:
            verdict = lookup_failed(vm, lookup, "no installation token")
            report.unjudged.append(_outcome(vm, verdict, lookup, runner_id))
        return report
    sem = asyncio.Semaphore(LOOKUP_CONCURRENCY)

    async def bounded(lookup: Lookup) -> tuple[RunInfo, JobInfo | None] | GitHubError:
        async with sem:
            return await _read(reader, lookup, first=False)

    results += await asyncio.gather(*(bounded(lk) for _, lk, _ in pending[1:]))

    # 4. judge, 5. act
    scope = _scope(raw)
    for (vm, lookup, runner_id), result in zip(pending, results, strict=True):
        if isinstance(result, GitHubError):
            verdict = lookup_failed(vm, lookup, str(result))
        else:
            run, job = result
            verdict = judge(
                vm,
                run,
                job,
                now,
                max_job_seconds=spec.max_job_seconds,
                completed_grace_seconds=spec.completed_grace_seconds,
            )
        outcome = _outcome(vm, verdict, lookup, runner_id)
        if verdict.action is not Action.DELETE:
            _file(report, outcome)
        elif spec.dry_run:
            log.info(
                "pool %s/%s: would delete VM %s (dry run): %s", ns, name, vm.name, verdict.reason
            )
            report.would_delete.append(outcome)
        else:
            await _delete(kube, raw, report, outcome, deregister, scope)
    return report


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def _reap_vm(obj: Mapping[str, Any]) -> tuple[ReapVM, int | None]:
    meta = obj["metadata"]
    name = str(meta["name"])
    deleting = bool(meta.get("deletionTimestamp"))
    try:
        status = ImpVM.model_validate(obj).status
    except ValidationError:
        # the API server validated the object, so this is a record we cannot read: not judged
        job = (obj.get("status") or {}).get("job") or {}
        return (
            ReapVM(
                name=name,
                deleting=deleting,
                workflow_run_id=job.get("workflowRunId", "unreadable"),
                repository=None,
            ),
            None,
        )
    runner_id = status.runner.id if status is not None and status.runner else None
    return ReapVM.from_status(name=name, deleting=deleting, status=status), runner_id


def _file(report: ReapReport, outcome: ReapOutcome) -> None:
    if outcome.verdict.action is Action.NOT_JUDGED:
        report.unjudged.append(outcome)
    else:
        report.kept.append(outcome)


def _outcome(vm: ReapVM, verdict: Verdict, lookup: Lookup, runner_id: int | None) -> ReapOutcome:
    return ReapOutcome(
        vm=vm.name,
        verdict=verdict,
        run_id=lookup.run_id,
        repository=lookup.repository,
        runner_id=runner_id,
    )


def _scope(raw: Mapping[str, Any]) -> Scope | None:
    scope = ImpVMRunnerPool.model_validate(raw).spec.platform.scope
    try:
        return Scope(org=scope.org, repo=scope.repo)
    except ValueError:
        return None


async def _read(
    reader: GitHubClient, lookup: Lookup, *, first: bool
) -> tuple[RunInfo, JobInfo | None] | GitHubError:
    """GET the run and, when it is not completed and a job id is known, the job. Returns what
    was read or the error (a 404 becomes a :class:`NotFound`-like error text). Raises
    :class:`_TokenNotMinted` when ``first`` and the token exchange failed."""
    try:
        run = await reader.get_run(lookup.repository, lookup.run_id)
        if run is None:
            return GitHubError(f"run {lookup.run_id} not found (404)", status=404)
        info = RunInfo(
            status=run.status or "unknown", conclusion=run.conclusion, updated_at=run.updated_at
        )
        if info.status == "completed" or lookup.job_id is None:
            return info, None
        job = await reader.get_job(lookup.repository, lookup.job_id)
        if job is None:
            return GitHubError(f"job {lookup.job_id} not found (404)", status=404)
        return info, JobInfo(
            status=job.status,
            conclusion=job.conclusion,
            started_at=job.started_at,
            completed_at=job.completed_at,
        )
    except GitHubError as e:
        if first and e.endpoint == TOKEN_ENDPOINT:
            raise _TokenNotMinted(e) from None
        return e


def _token_message(err: GitHubError) -> str:
    perms = ", ".join(f"{k}: {v}" for k, v in REAPER_PERMISSIONS.items())
    if isinstance(err, PermissionNotGranted):
        return (
            f"the GitHub App installation lacks the permission {perms}: GitHub refused an "
            f"installation token restricted to it ({err}); deleted nothing"
        )
    if isinstance(err, InstallationUnavailable):
        return (
            f"no {perms} installation token: the GitHub App installation is unavailable "
            f"({err.reason}: {err}); deleted nothing"
        )
    return (
        f"no {perms} installation token could be minted ({type(err).__name__}: {err}); "
        "deleted nothing"
    )


async def _delete(
    kube: AsyncClient,
    raw: Mapping[str, Any],
    report: ReapReport,
    outcome: ReapOutcome,
    deregister: GitHubClient | None,
    scope: Scope | None,
) -> None:
    ns, name = report.namespace, report.pool
    dereg: str | None = None
    if deregister is not None and scope is not None and outcome.runner_id is not None:
        try:
            result = await deregister.delete_runner(scope, outcome.runner_id)
            dereg = result.value
        except GitHubError as e:
            dereg = "failed"
            log.info(
                "pool %s/%s: runner %s of VM %s not deregistered (%s); deleting the VM anyway",
                ns,
                name,
                outcome.runner_id,
                outcome.vm,
                e,
            )
    done = ReapOutcome(
        vm=outcome.vm,
        verdict=outcome.verdict,
        run_id=outcome.run_id,
        repository=outcome.repository,
        runner_id=outcome.runner_id,
        deregistration=dereg,
    )
    try:
        await kube.delete(ImpVMResource, outcome.vm, namespace=ns)
    except ApiError as e:
        if e.status.code != 404:
            log.warning(
                "pool %s/%s: deleting VM %s failed (HTTP %s)", ns, name, outcome.vm, e.status.code
            )
            report.failed.append(done)
            return
    report.deleted.append(done)
    runner = f"runner {outcome.runner_id}" if outcome.runner_id is not None else "no runner id"
    dereg_text = {
        None: "",
        DeleteOutcome.DELETED.value: ", runner deregistered",
        DeleteOutcome.BUSY.value: ", runner still busy at GitHub (released when its job ends)",
        DeleteOutcome.NOT_FOUND.value: ", runner already deregistered",
        "failed": ", runner deregistration failed",
    }[dereg]
    message = (
        f"deleted VM {outcome.vm} ({runner}{dereg_text}): run {outcome.run_id} in "
        f"{outcome.repository}, rule {outcome.verdict.rule}: {outcome.verdict.reason}"
    )
    log.info("pool %s/%s: %s", ns, name, message)
    await _event(kube, raw, "RunnerReaped", message)


# --------------------------------------------------------------------------------------------
# Reporting


async def record_report(
    kube: AsyncClient, pool: Any, report: ReapReport, now: dt.datetime | None = None
) -> None:
    """Write the pool's ``Reaper`` condition from ``report`` (a status merge patch carrying the
    pool's other conditions unchanged, guarded by ``resourceVersion`` and retried on conflict)
    and, when the condition's status, reason or message changed to a failure, a Warning Event.
    ``now`` is when the pass ran (default: now). A skipped report writes nothing. Kubernetes
    failures are logged, not raised."""
    if report.skipped:
        return
    now = now or utcnow()
    raw = _as_dict(pool)
    ns, name = report.namespace, report.pool
    if report.error is not None:
        ok, reason = False, report.error_reason or "Failed"
    elif report.unjudged:
        ok, reason = False, "NotJudged"
    elif report.failed:
        ok, reason = False, "DeleteFailed"
    else:
        ok, reason = True, "PassComplete"
    message = report.summary()
    if not report.complete:
        log.warning("pool %s/%s: reaper %s: %s", ns, name, reason, message)
    else:
        log.info("pool %s/%s: reaper: %s", ns, name, message)
    changed = False
    for _ in range(5):
        try:
            fresh = (await kube.get(ImpVMRunnerPoolResource, name, namespace=ns)).to_dict()
        except ApiError as e:
            if e.status.code != 404:
                log.warning("pool %s/%s: cannot read the pool (HTTP %s)", ns, name, e.status.code)
            return
        fmeta = fresh["metadata"]
        conds = ConditionSet.from_status(fresh.get("status"), int(fmeta.get("generation", 0)))
        before = next((c for c in conds.as_list() if c["type"] == CONDITION_TYPE), None)
        conds.set(CONDITION_TYPE, ok, reason, message, now)
        after = next(c for c in conds.as_list() if c["type"] == CONDITION_TYPE)
        changed = before is None or any(
            before.get(k) != after[k] for k in ("status", "reason", "message")
        )
        if not changed:
            break
        patch = {
            "metadata": {"resourceVersion": fmeta["resourceVersion"]},
            "status": {"conditions": conds.as_list()},
        }
        try:
            await kube.patch(
                ImpVMRunnerPoolResource.Status,
                name,
                patch,
                namespace=ns,
                patch_type=PatchType.MERGE,
            )
            break
        except ApiError as e:
            if e.status.code == 409:
                continue
            if e.status.code != 404:
                log.warning(
                    "pool %s/%s: cannot write the Reaper condition (HTTP %s)",
                    ns,
                    name,
                    e.status.code,
                )
            return
    if changed and not ok:
        await _event(kube, raw, f"Reaper{reason}", message, warning=True)


async def _event(
    kube: AsyncClient, pool: Mapping[str, Any], reason: str, message: str, warning: bool = False
) -> None:
    """A core/v1 Event about the pool (:class:`impvm.events.EventRecorder`: message cut to
    1 KiB, failures logged only)."""
    meta = pool["metadata"]
    await EventRecorder(kube, component=COMPONENT).record(
        api_version=API_VERSION,
        kind="ImpVMRunnerPool",
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta.get("uid", ""),
        reason=reason,
        message=message,
        warning=warning,
    )


# --------------------------------------------------------------------------------------------
# The loop


async def reaper_loop(
    ctx: OperatorContext,
    key: PoolKey,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Reaper passes for pool ``key`` until it is deleted: a pass, then ``spec.reaper.
    intervalSeconds`` of sleep (re-read each time). A pool whose reaper is disabled is only
    re-checked at that interval. One loop per pool: passes never overlap. The loop gets its
    client from the operator's provider (the pool's installation's, shared with the pool
    controller), so the ``actions: read`` token is minted about once an hour, not once per
    pass. Unexpected errors are logged and the pass is retried after 30 s. Returns when the
    pool is gone or being deleted."""
    ns, name = key
    while True:
        try:
            raw = (await ctx.kube.get(ImpVMRunnerPoolResource, name, namespace=ns)).to_dict()
        except ApiError as e:
            if e.status.code == 404:
                return
            log.warning(
                "pool %s/%s: reaper cannot read the pool (HTTP %s)", ns, name, e.status.code
            )
            await sleep(ERROR_RETRY_SECONDS)
            continue
        if raw["metadata"].get("deletionTimestamp"):
            return
        spec = _reaper_spec(raw)
        interval = float(spec.interval_seconds if spec else DEFAULT_INTERVAL_SECONDS)
        if spec is None or not spec.enabled:
            await sleep(interval)
            continue
        now = ctx.clock.now()
        try:
            platform = ImpVMRunnerPool.model_validate(raw).spec.platform
            client = await ctx.github.client(ns, platform)
            await reap_pool(ctx.kube, client, raw, now, deregister=client)
        except CredentialsError as e:
            report = ReapReport(
                namespace=ns,
                pool=name,
                error=f"{e}; deleted nothing",
                error_reason="CredentialsInvalid",
            )
            await record_report(ctx.kube, raw, report, now)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed pass is retried; messages carry no secrets
            log.warning("pool %s/%s: reaper pass failed: %s: %s", ns, name, type(e).__name__, e)
            interval = min(interval, ERROR_RETRY_SECONDS)
        await sleep(interval)
