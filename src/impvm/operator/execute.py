"""Carries out a :class:`~impvm.scaling.poolpass.PoolPlan`: Kubernetes writes and GitHub calls
in the plan's order, the pool's Events and status. No decision is made here.

The ImpVM is created before its JIT Secret; the Secret (owned by the VM) is written before its
name is recorded on the VM; the runner id is recorded last — so a crash between any two steps is
repaired by the next pass. A deregistration that must come first keeps the VM unless GitHub
accepted it (a busy runner answers 422).
"""

from __future__ import annotations

import logging
import secrets as pysecrets
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from typing import Any, TypeVar, cast

from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.api.conditions import merge_conditions
from impvm.api.models import API_VERSION, PoolKey
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.github import REPO_RUNNER_GROUP_ID, DeleteOutcome, GitHubClient
from impvm.github.errors import GitHubError, InstallationUnavailable, RateLimited
from impvm.operator import metrics
from impvm.operator.context import OperatorContext
from impvm.operator.credentials import scope_of
from impvm.scaling.names import secret_name, vm_name
from impvm.scaling.poolpass import (
    DeleteVM,
    EventSpec,
    Mint,
    Outcome,
    PoolPlan,
    jit_secret_manifest,
    vm_manifest,
)
from impvm.scaling.world import GitHubFailure, PoolWorld
from impvm.vm_metrics import record_phase

log = logging.getLogger("impvm.operator.pool")

MERGE = PatchType.MERGE
T = TypeVar("T")


def failure_of(err: GitHubError, vm: str | None = None) -> GitHubFailure:
    """The decision's view of a GitHub error (messages are redacted by the client)."""
    return GitHubFailure(
        kind=type(err).__name__,
        message=str(err),
        retry_after=err.retry_after if isinstance(err, RateLimited) else 0.0,
        rate_kind=err.kind if isinstance(err, RateLimited) else "",
        unavailable_reason=err.reason if isinstance(err, InstallationUnavailable) else "",
        vm=vm,
    )


class PlanExecutor:
    """Carries out the plans of one pass over ``world.pool`` with client ``gh`` (None when the
    pool's credentials could not be used)."""

    def __init__(self, ctx: OperatorContext, world: PoolWorld, gh: GitHubClient | None) -> None:
        self.ctx, self.world, self.gh = ctx, world, gh
        self.ns = world.pool.namespace
        self.scope = scope_of(world.pool.spec.platform)

    async def run(self, plan: PoolPlan) -> Outcome:
        """Every act of ``plan``, in order; returns what happened. A replica that is not the
        leader (``ctx.leading``, the fencing check) acts on nothing."""
        if not self.ctx.leading():
            log.warning("pool %s/%s: not acting: not the leader", *self.key)
            return Outcome()
        kube = self.ctx.kube
        for r in plan.releases:
            meta = {"resourceVersion": r.resource_version, "finalizers": list(r.finalizers)}
            patch = kube.patch(
                ImpVMResource, r.name, {"metadata": meta}, namespace=self.ns, patch_type=MERGE
            )
            await self._tolerate(self._vm_written(patch), r.event)
        nodes = {v.name: v.spec.node_name or "" for v in self.world.vms}
        for p in plan.lost:
            await self._tolerate(self._patch_status(p.name, p.status), p.event)
            if phase := p.status.get("phase"):
                record_phase(nodes.get(p.name, ""), None, str(phase))
        for d in plan.deletions:
            await self._delete(d)
        for reg in plan.registrations if self.gh else ():
            try:
                await self._changing(self.gh.delete_runner(self.scope, reg.runner_id))  # type: ignore[union-attr]
            except GitHubError as e:
                log.warning("pool %s/%s: could not remove registration: %s", *self.key, e)
                continue
            await self.event(reg.done)
        outcome = await self._provision(plan)
        for s in plan.sync:
            if await self._tolerate(self._patch_status(s.name, s.status), None):
                for kind, seconds in s.observe:
                    metrics.OBSERVED[kind].labels(*self.key).observe(seconds)
        return outcome

    async def _changing(self, call: Awaitable[T]) -> T:
        """Await a GitHub call that may create or delete one of the pool's registrations; then
        (also when it failed: it may have reached GitHub) no runner list begun before it is used
        for the pool (:mod:`impvm.operator.runners`)."""
        try:
            return await call
        finally:
            if self.gh is not None:
                mono = self.ctx.clock.monotonic()
                self.ctx.runners.changed(self.gh, self.scope, self.world.pool.prefix, mono)

    @property
    def key(self) -> PoolKey:
        return self.world.pool.key

    async def _tolerate(self, write: Awaitable[Any], event: EventSpec | None) -> bool:
        """Await a VM write; a VM gone (404) or changed meanwhile (409) is left to the next
        pass (False). ``event`` is recorded once the write succeeded."""
        try:
            await write
        except ApiError as e:
            if e.status.code not in (404, 409):
                raise
            return False
        if event is not None:
            await self.event(event)
        return True

    async def _delete(self, d: DeleteVM) -> None:
        """Delete a VM; deregister its runner first when asked (a busy runner keeps its VM).
        For terminal VMs the deregistration is best effort (the orphan sweep catches the rest);
        a VM that must be deregistered first is kept when GitHub cannot be asked."""
        if d.deregister and self.gh is not None and d.runner_id is not None:
            try:
                result = await self._changing(self.gh.delete_runner(self.scope, d.runner_id))
            except GitHubError as e:
                if d.deregister_first:
                    log.info("keeping %s/%s: deregistration failed: %s", self.ns, d.name, e)
                    return
                result = DeleteOutcome.NOT_FOUND
            if result is DeleteOutcome.BUSY:
                await self.event(d.busy)
                return
        elif d.deregister_first and d.runner_id is not None:
            return
        deleted = self.ctx.kube.delete(ImpVMResource, d.name, namespace=self.ns)
        if await self._tolerate(deleted, d.done):
            # its lifetime is observed when the API server removes it (operator/sources.py)
            self.ctx.sources.vm_deleted(self.ns, d.name)

    async def _provision(self, plan: PoolPlan) -> Outcome:
        """Mint the missing JIT configs, then create VMs, each minted at once; the first
        failure ends both (the VM created last stays without setup until a later pass)."""
        for m in plan.mints:
            if (stop := await self._mint(m)) is not None:
                return stop
        for n in range(plan.create):
            name, uid = await self._create(plan)
            mint = Mint(
                vm=name,
                vm_uid=uid,
                secret=secret_name(name),
                stale_runner_id=None,
                record_only=False,
            )
            if (stop := await self._mint(mint)) is not None:
                return replace(stop, created=n + 1)
        return Outcome(created=plan.create)

    async def _create(self, plan: PoolPlan) -> tuple[str, str]:
        """Create one ImpVM as the plan says, controlled by the pool; returns name and uid."""
        assert plan.new_vm is not None
        name = vm_name(self.world.pool.prefix, pysecrets.token_hex(3))
        body = vm_manifest(self.world.pool, plan.new_vm, name)
        created = (await self.ctx.kube.create(ImpVMResource.from_dict(body))).to_dict()
        self.ctx.sources.written(ImpVMResource, created)
        return name, str(created["metadata"]["uid"])

    async def _mint(self, m: Mint) -> Outcome | None:
        """Mint a JIT config for VM ``m.vm``, write its Secret (owned by the VM), record it, then
        the runner id (a VM with a runner id but no Secret is never minted again). Returns None
        on success, else the :class:`Outcome` that stops the acts."""
        if m.record_only:
            await self._record(m.vm, m.secret)
            return None
        if self.gh is None:
            return Outcome()
        if not self.ctx.leading():  # fencing: a replica that lost its Lease mints nothing
            log.warning("not minting a JIT config for %s/%s: not the leader", self.ns, m.vm)
            return Outcome()
        spec = self.world.pool.spec
        try:
            if m.stale_runner_id is not None:
                stale = self.gh.delete_runner(self.scope, m.stale_runner_id)
                if await self._changing(stale) is DeleteOutcome.BUSY:
                    return Outcome()
            group = REPO_RUNNER_GROUP_ID
            if self.scope.org is not None:
                group = await self._runner_group(self.scope.org, spec.platform.runner_group)
            minted = self.gh.generate_jitconfig(self.scope, m.vm, group, spec.labels)
            jit = await self._changing(minted)
        except GitHubError as e:
            failure = failure_of(e, vm=m.vm)
            metrics.JIT_MINTS.labels(*self.key, failure.kind).inc()
            return Outcome(failure=failure)
        body = jit_secret_manifest(self.world.pool, m, jit.encoded_jit_config.get_secret_value())
        try:
            made = await self.ctx.kube.create(cast(Secret, Secret.from_dict(body)))
            self.ctx.sources.written(Secret, made.to_dict())
        except ApiError as e:
            if e.status.code != 409:
                metrics.JIT_MINTS.labels(*self.key, "SecretWriteFailed").inc()
                text = f"JIT Secret {m.secret} could not be written (HTTP {e.status.code})"
                return Outcome(secret_write_failed=text)
        metrics.JIT_MINTS.labels(*self.key, "ok").inc()
        await self._record(m.vm, m.secret)
        await self._patch_status(m.vm, {"runner": {"id": jit.runner_id, "name": jit.runner_name}})
        return None

    async def _runner_group(self, org: str, name: str | None) -> int:
        """The org runner group id (paginated lookup), cached per pool for
        ``runner_group_ttl`` seconds: every JIT config needs it and it rarely changes."""
        mem, mono = self.ctx.pool(self.key), self.world.mono
        cached = mem.runner_group
        if cached and cached[0] == (org, name) and mono < cached[2]:
            return cached[1]
        assert self.gh is not None
        gid = await self.gh.runner_group_id(org, name)
        mem.runner_group = ((org, name), gid, mono + self.ctx.settings.runner_group_ttl)
        return gid

    async def _record(self, vm: str, secret: str) -> None:
        """Record the JIT Secret's name in the VM's ``spec.runnerConfigSecret``."""
        patch = {"spec": {"runnerConfigSecret": secret}}
        await self._vm_written(
            self.ctx.kube.patch(ImpVMResource, vm, patch, namespace=self.ns, patch_type=MERGE)
        )

    async def _patch_status(self, name: str, status: Mapping[str, Any]) -> None:
        patch = {"status": dict(status)}
        await self._vm_written(
            self.ctx.kube.patch(
                ImpVMResource.Status, name, patch, namespace=self.ns, patch_type=MERGE
            )
        )

    async def _vm_written(self, write: Awaitable[Any]) -> None:
        """Await a VM write and hand the VM it returned to the caches (own writes)."""
        obj = await write
        if obj is not None:
            self.ctx.sources.written(ImpVMResource, obj.to_dict())

    async def write_status(
        self, status: Mapping[str, Any], ours: tuple[Mapping[str, Any], ...]
    ) -> None:
        """Patch the pool's status. Other writers (the reaper) own other condition types: ours
        are merged into what is stored now, guarded by resourceVersion, retried on conflict."""
        name, src = self.world.pool.name, self.ctx.sources
        for attempt in range(5):
            # the cache first; after a conflict, the API server's current version
            read = src.get if attempt == 0 else src.api_get
            cur = await read(ImpVMRunnerPoolResource, name, self.ns)
            if cur is None:
                return
            stored = (cur.get("status") or {}).get("conditions") or []
            body: dict[str, Any] = {
                "metadata": {"resourceVersion": cur["metadata"]["resourceVersion"]}
            }
            body["status"] = {**status, "conditions": merge_conditions(stored, ours)}
            try:
                done = await self.ctx.kube.patch(
                    ImpVMRunnerPoolResource.Status, name, body, namespace=self.ns, patch_type=MERGE
                )
                src.written(ImpVMRunnerPoolResource, done.to_dict())
                return
            except ApiError as e:
                if e.status.code == 404:
                    return
                if e.status.code != 409:
                    raise

    async def event(self, ev: EventSpec) -> None:
        """An Event on the pool (the recorder also logs it)."""
        await self.ctx.events.record(
            api_version=API_VERSION,
            kind="ImpVMRunnerPool",
            namespace=self.ns,
            name=self.world.pool.name,
            uid=self.world.pool.uid,
            reason=ev.reason,
            message=ev.message,
            warning=ev.warning,
        )
