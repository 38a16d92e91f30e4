"""The reaper's shell: one pass per pool over the VMs whose runner may have outlived its job, in
the pool pass's shape: observe -> decide (pure) -> execute (the shared executor) -> conclude
(pure, :mod:`impvm.reaper.reap`).

A pass (:meth:`Reaper.reap`) for a pool with ``spec.reaper.enabled``:

1. reads the pool's ImpVMs (the operator's caches, or the API server; only those the pool
   controls: never touch what this pool did not create);
2. asks :func:`impvm.reaper.reap_lookups` which of them need GitHub (idle VMs, VMs being
   deleted and malformed job records are decided without any call), then reads for each its
   workflow run (and, when the run is not completed and a job id is recorded, its job) with an
   installation token restricted to ``actions: read`` (:data:`REAPER_PERMISSIONS`). The first
   read mints the token (cached by the client for its lifetime); when it cannot be minted the
   pass reads nothing else and **deletes nothing**;
3. judges each VM (:func:`impvm.reaper.reap_acts`; a VM whose run or job could not be read is
   not judged);
4. deletes each VM judged ``delete`` through :class:`~impvm.operator.execute.Executor`: its
   runner deregistered first when a ``deregister`` client is given (a 422 "still running a job"
   does not stop the deletion: GitHub releases a hung job's runner once the VM is gone); with
   ``spec.reaper.dryRun`` it only logs "would delete";
5. concludes (:func:`impvm.reaper.conclude_reap`): the pool's ``Reaper`` condition (written
   when it changed) and Events, the decision metrics.

Scheduling (:func:`reaper_loop`): one loop per pool (a kopf daemon), a pass every
``spec.reaper.intervalSeconds`` (default 300 s), so passes of one pool never overlap; a
:class:`Reaper` also serialises direct calls of one pool's passes (locks held only while a pass
runs). The loop's client comes from the operator's
:class:`~impvm.operator.credentials.GitHubProvider` (one token cache per installation).

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
from dataclasses import replace
from typing import Any, Final

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError

from impvm.api.models import PoolKey
from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.github import GitHubClient
from impvm.github.errors import (
    BadCredentials,
    CredentialsError,
    GitHubError,
    InstallationUnavailable,
    PermissionNotGranted,
)
from impvm.kube.events import EventRecorder
from impvm.operator.context import OperatorContext
from impvm.operator.execute import Executor
from impvm.operator.kubesource import KubeSource
from impvm.operator.metrics import REAPER_DECISIONS
from impvm.reaper import (
    CONDITION_TYPE,
    Answer,
    JobInfo,
    Lookup,
    ReapEvent,
    ReapReport,
    ReapWorld,
    RunInfo,
    conclude_reap,
    reap_acts,
    reap_lookups,
)
from impvm.scaling.poolpass import DeleteVM, EventSpec, PoolObj

__all__ = [
    "CONDITION_TYPE",
    "REAPER_PERMISSIONS",
    "STALE_RECHECK_SECONDS",
    "Reaper",
    "reap_pool",
    "reaper_enabled",
    "reaper_loop",
]

log = logging.getLogger("impvm.operator.reaper")

#: The only permission of the installation token a pass mints (least privilege).
REAPER_PERMISSIONS: Final[Mapping[str, str]] = {"actions": "read"}
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
#: seconds before a pool read as reaper-disabled is read again (a cache behind kopf's event)
STALE_RECHECK_SECONDS: Final = 1.0


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


class Reaper:
    """Reaper passes through one Kubernetes client (``sources``: the operator's caches, else
    API reads). ``locks`` serialise the passes of one pool while they run (weak: a lock nobody
    holds is forgotten, so pools that come and go leave nothing behind)."""

    def __init__(
        self,
        kube: AsyncClient,
        *,
        sources: KubeSource | None = None,
        recorder: EventRecorder | None = None,
    ) -> None:
        self.kube = kube
        self.sources = sources or KubeSource(kube)
        self.recorder = recorder or EventRecorder(kube, component=COMPONENT)
        self.locks: weakref.WeakValueDictionary[PoolKey, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    async def reap(
        self,
        github: GitHubClient | None,
        pool: Any,
        now: dt.datetime,
        *,
        deregister: GitHubClient | None = None,
        error: tuple[str, str] | None = None,
    ) -> ReapReport:
        """One pass over ``pool`` (a dict as the API server returns it, or a lightkube resource)
        (see the module docstring). ``github``: the pool's client, of which only the ``actions:
        read`` view is used; ``deregister``: a client allowed to delete runners (without it
        registrations are left to the pool controller's orphan sweep); ``now``: the pass's clock
        reading; ``error``: ``(reason, message)`` when the pass cannot run at all (it then
        only reports). A disabled reaper touches nothing (``skipped``). Kubernetes errors other
        than those reported propagate; GitHub errors never do."""
        obj = PoolObj.from_body(_as_dict(pool))
        spec = obj.spec.reaper
        if spec is None or not spec.enabled:
            return ReapReport(namespace=obj.namespace, pool=obj.name, skipped=True)
        lock = self.locks.get(obj.key)
        if lock is None:
            lock = self.locks[obj.key] = asyncio.Lock()
        async with lock:
            world = await self._observe(github, obj, now, error)
            acts = reap_acts(world)
            # counted as judged, before any deletion or status write that may fail the pass
            for o in acts.outcomes:
                REAPER_DECISIONS.labels(
                    obj.namespace, obj.name, o.verdict.action, o.verdict.rule
                ).inc()
            executor = Executor(
                self.kube, obj, gh=deregister, recorder=self.recorder, sources=self.sources
            )
            done: dict[str, tuple[str | None, bool]] = {}
            for o in acts.delete:
                d = await executor.delete(
                    DeleteVM(
                        name=o.vm,
                        runner_id=o.runner_id,
                        deregister=deregister is not None,
                        keep_if_busy=False,
                    )
                )
                dereg = d.deregistration.value if d.deregistration is not None else None
                done[o.vm] = (dereg, d.gone)
            end = conclude_reap(world, acts, done)
            await self._report(executor, end.report, end.condition, end.events)
        return end.report

    async def _observe(
        self,
        github: GitHubClient | None,
        pool: PoolObj,
        now: dt.datetime,
        error: tuple[str, str] | None,
    ) -> ReapWorld:
        """The pool's controlled VMs, then GitHub's answers for those that need one."""
        assert pool.spec.reaper is not None
        world = ReapWorld(
            namespace=pool.namespace,
            pool=pool.name,
            spec=pool.spec.reaper,
            now=now,
            stored_status=pool.stored_status,
            generation=pool.generation,
        )
        if error is not None:
            return replace(world, error_reason=error[0], error=error[1])
        try:
            found = await self.sources.vms(pool)
        except ApiError as e:
            text = f"listing the pool's ImpVMs failed (HTTP {e.status.code}); deleted nothing"
            return replace(world, error_reason="ListFailed", error=text)
        vms = tuple(v for v in found if v.controller_uid == pool.uid)
        world = replace(world, vms=vms)
        lookups = reap_lookups(vms)
        if not lookups or github is None:
            return world
        reader = github.with_permissions(REAPER_PERMISSIONS)
        answers: dict[str, Answer] = {}
        try:
            answers[lookups[0][0].name] = await _read(reader, lookups[0][1], first=True)
        except _TokenNotMinted as e:
            refused = (PermissionNotGranted, BadCredentials, InstallationUnavailable)
            reason = "TokenRefused" if isinstance(e.error, refused) else "TokenUnavailable"
            unread = {vm.name: "no installation token" for vm, _ in lookups}
            return replace(
                world, answers=unread, error_reason=reason, error=_token_message(e.error)
            )
        sem = asyncio.Semaphore(LOOKUP_CONCURRENCY)

        async def bounded(lookup: Lookup) -> Answer:
            async with sem:
                return await _read(reader, lookup, first=False)

        rest = await asyncio.gather(*(bounded(lk) for _, lk in lookups[1:]))
        answers |= {vm.name: a for (vm, _), a in zip(lookups[1:], rest, strict=True)}
        return replace(world, answers=answers)

    async def _report(
        self,
        executor: Executor,
        report: ReapReport,
        condition: dict[str, Any] | None,
        events: tuple[ReapEvent, ...],
    ) -> None:
        """Log the pass, write its condition when it changed, record its Events (Kubernetes
        failures are logged, not raised: the next pass reports again)."""
        ns, name = report.namespace, report.pool
        for o in report.would_delete:
            log.info(
                "pool %s/%s: would delete VM %s (dry run): %s", ns, name, o.vm, o.verdict.reason
            )
        for o in report.deleted:
            log.info("pool %s/%s: reaped VM %s: %s", ns, name, o.vm, o.verdict.reason)
        if not report.complete:
            reason = report.error_reason or ("NotJudged" if report.unjudged else "DeleteFailed")
            log.warning("pool %s/%s: reaper %s: %s", ns, name, reason, report.summary())
        else:
            log.info("pool %s/%s: reaper: %s", ns, name, report.summary())
        if condition is not None:
            try:
                await executor.write_status(None, [condition])
            except ApiError as e:
                log.warning(
                    "pool %s/%s: cannot write the Reaper condition (HTTP %s)",
                    ns,
                    name,
                    e.status.code,
                )
        for ev in events:
            await executor.event(EventSpec(ev.reason, ev.message, ev.warning))


async def reap_pool(
    kube: AsyncClient,
    github: GitHubClient,
    pool: Any,
    now: dt.datetime,
    *,
    deregister: GitHubClient | None = None,
) -> ReapReport:
    """One reaper pass over ``pool`` (:meth:`Reaper.reap` of a reaper of its own)."""
    return await Reaper(kube).reap(github, pool, now, deregister=deregister)


async def _read(reader: GitHubClient, lookup: Lookup, *, first: bool) -> Answer:
    """GET the run and, when it is not completed and a job id is known, the job. Returns what
    was read or why it could not be. Raises :class:`_TokenNotMinted` when ``first`` and the
    token exchange failed."""
    try:
        run = await reader.get_run(lookup.repository, lookup.run_id)
        if run is None:
            return f"run {lookup.run_id} not found (404)"
        info = RunInfo(
            status=run.status or "unknown", conclusion=run.conclusion, updated_at=run.updated_at
        )
        if info.status == "completed" or lookup.job_id is None:
            return info, None
        job = await reader.get_job(lookup.repository, lookup.job_id)
        if job is None:
            return f"job {lookup.job_id} not found (404)"
        return info, JobInfo(
            status=job.status,
            conclusion=job.conclusion,
            started_at=job.started_at,
            completed_at=job.completed_at,
        )
    except GitHubError as e:
        if first and e.endpoint == TOKEN_ENDPOINT:
            raise _TokenNotMinted(e) from None
        return str(e)


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


async def reaper_loop(
    ctx: OperatorContext,
    key: PoolKey,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Reaper passes for pool ``key`` until it is deleted: a pass, then ``spec.reaper.
    intervalSeconds`` of sleep (re-read each time). A pool read with its reaper disabled (the
    operator's cache not yet at the change kopf started the loop for) is read again after
    :data:`STALE_RECHECK_SECONDS`, never after the interval the old spec names. The client
    comes from the operator's provider (the pool's installation's, shared with the pool
    controller), so the ``actions: read`` token is minted about once an hour. Unexpected
    errors are logged and the pass is retried after 30 s. Returns when the pool is gone or
    being deleted."""
    ns, name = PoolKey(*key)
    reaper = Reaper(ctx.kube, sources=ctx.sources)
    while True:
        try:
            raw = await ctx.sources.get(ImpVMRunnerPoolResource, name, ns)
        except ApiError as e:
            log.warning(
                "pool %s/%s: reaper cannot read the pool (HTTP %s)", ns, name, e.status.code
            )
            await sleep(ERROR_RETRY_SECONDS)
            continue
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return
        spec = PoolObj.from_body(raw).spec
        interval = float(spec.reaper.interval_seconds if spec.reaper else DEFAULT_INTERVAL_SECONDS)
        if spec.reaper is None or not spec.reaper.enabled:
            # kopf runs this loop only while the pool's reaper is enabled: a reading that says
            # otherwise is a watch cache behind the event kopf started it for
            await sleep(STALE_RECHECK_SECONDS)
            continue
        now = ctx.clock.now()
        try:
            try:
                client = await ctx.github.client(ns, spec.platform)
            except CredentialsError as e:
                error = ("CredentialsInvalid", f"{e}; deleted nothing")
                await reaper.reap(None, raw, now, error=error)
            else:
                await reaper.reap(client, raw, now, deregister=client)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed pass is retried; messages carry no secrets
            log.warning("pool %s/%s: reaper pass failed: %s: %s", ns, name, type(e).__name__, e)
            interval = min(interval, ERROR_RETRY_SECONDS)
        await sleep(interval)
