"""Carrying a pool pass's acts out (:class:`PoolExecutor`): lost-node releases and failures,
deletions, orphan registrations, JIT mints and new VMs, then the VM records, in that order.

Provisioning keeps the crash-safe order: the ImpVM is created, then its JIT config minted, the
Secret (owned by the VM) written, its name recorded on the VM, the runner id recorded last. A
VM with a runner id but no Secret is never minted again; a Secret not recorded is recorded by
the next pass; a registration without its Secret is replaced by the next mint. Every mint is
charged to the installation's JIT mint budget (:mod:`impvm.scaling.mintbudget`) and fenced by
leadership (a replica that lost its Lease mints nothing).
"""

from __future__ import annotations

import logging
import secrets as pysecrets
from dataclasses import replace
from typing import cast

from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from impvm.api.models import ImpVMStatus, RunnerStatus
from impvm.api.resources import ImpVMResource
from impvm.github import REPO_RUNNER_GROUP_ID, DeleteOutcome, GitHubClient
from impvm.github.errors import GitHubError
from impvm.operator import metrics
from impvm.operator.context import OperatorContext
from impvm.operator.execute import MERGE, Executor, failure_of
from impvm.operator.manifests import get_jit_secret, get_vm
from impvm.scaling.names import secret_name, vm_name
from impvm.scaling.poolpass import ActsDone, MintJit, PoolActs, PoolWorld
from impvm.telemetry.vm_metrics import record_phase

log = logging.getLogger("impvm.operator.pool")


class PoolExecutor(Executor):
    """Carries out the acts of one pass over ``world.pool`` with client ``gh`` (None when the
    pool's credentials could not be used)."""

    def __init__(self, ctx: OperatorContext, world: PoolWorld, gh: GitHubClient | None) -> None:
        super().__init__(
            ctx.kube,
            world.pool,
            gh=gh,
            recorder=ctx.events,
            sources=ctx.sources,
            runners=ctx.runners,
            clock=ctx.clock.monotonic,
        )
        self.ctx, self.world = ctx, world

    async def run(self, acts: PoolActs) -> ActsDone:
        """Every act, in order; returns what they did. A replica that is not the leader
        (``ctx.leading``, the fencing check) acts on nothing."""
        if not self.ctx.leading():
            log.warning("pool %s/%s: not acting: not the leader", *self.key)
            return ActsDone()
        for r in acts.releases:
            meta = {"resourceVersion": r.resource_version, "finalizers": list(r.finalizers)}
            patch = self.kube.patch(
                ImpVMResource, r.name, {"metadata": meta}, namespace=self.ns, patch_type=MERGE
            )
            await self.tolerate(self.vm_written(patch), r.event)
        nodes = {v.name: v.node_name or "" for v in self.world.vms}
        for p in acts.lost:
            await self.tolerate(self.patch_vm_status(p.name, p.status), p.event)
            if p.status.phase is not None:
                record_phase(nodes.get(p.name, ""), None, p.status.phase.value)
        deleted = tuple([await self.delete(d) for d in acts.deletions])
        for reg in acts.registrations if self.gh else ():
            try:
                await self.changing(self.gh.delete_runner(self.scope, reg.runner_id))  # type: ignore[union-attr]
            except GitHubError as e:
                log.warning("pool %s/%s: could not remove registration: %s", *self.key, e)
                continue
            await self.event(reg.done)
        done = replace(await self._provision(acts), deleted=deleted)
        for s in acts.records:
            if await self.tolerate(self.patch_vm_status(s.name, s.status), s.event):
                for kind, seconds in s.observe:
                    metrics.OBSERVED[kind].labels(*self.key).observe(seconds)
        return done

    async def _provision(self, acts: PoolActs) -> ActsDone:
        """Mint the missing JIT configs, then create VMs, each minted at once; the first
        failure ends both (the VM created last stays without setup until a later pass)."""
        for m in acts.mints:
            if (stop := await self._mint(m)) is not None:
                return stop
        for n in range(acts.create):
            name, uid = await self._create(acts.made_from)
            mint = MintJit(
                vm=name,
                vm_uid=uid,
                secret=secret_name(name),
                stale_runner_id=None,
                record_only=False,
            )
            if (stop := await self._mint(mint)) is not None:
                return replace(stop, created=n + 1)
        return ActsDone(created=acts.create)

    async def _create(self, made_from: str) -> tuple[str, str]:
        """Create one ImpVM of the pool's template; returns its name and uid."""
        name = vm_name(self.pool.prefix, pysecrets.token_hex(3))
        body = get_vm(self.world, name, made_from)
        created = (await self.kube.create(ImpVMResource.from_dict(body))).to_dict()
        self.sources.written(ImpVMResource, created)
        return name, str(created["metadata"]["uid"])

    async def _mint(self, m: MintJit) -> ActsDone | None:
        """Mint a JIT config for VM ``m.vm``, write its Secret (owned by the VM), record it,
        then the runner id. Returns None on success, else what stops the acts."""
        if m.record_only:
            await self._record(m.vm, m.secret)
            return None
        if self.gh is None:
            return ActsDone()
        if not self.ctx.leading():  # fencing: a replica that lost its Lease mints nothing
            log.warning("not minting a JIT config for %s/%s: not the leader", self.ns, m.vm)
            return ActsDone()
        spec = self.pool.spec
        try:
            if m.stale_runner_id is not None:
                stale = self.gh.delete_runner(self.scope, m.stale_runner_id)
                if await self.changing(stale) is DeleteOutcome.BUSY:
                    return ActsDone()
            group = REPO_RUNNER_GROUP_ID
            if self.scope.org is not None:
                group = await self._runner_group(self.scope.org, spec.platform.runner_group)
            self.ctx.mint_budget(self.gh).charge(self.pool.prefix, self.ctx.clock.monotonic())
            minted = self.gh.generate_jitconfig(self.scope, m.vm, group, spec.labels)
            jit = await self.changing(minted)
        except GitHubError as e:
            failure = failure_of(e, vm=m.vm)
            metrics.JIT_MINTS.labels(*self.key, failure.kind.value).inc()
            return ActsDone(failure=failure)
        body = get_jit_secret(self.world, m, jit.encoded_jit_config.get_secret_value())
        try:
            made = await self.kube.create(cast(Secret, Secret.from_dict(body)))
            self.sources.written(Secret, made.to_dict())
        except ApiError as e:
            if e.status.code != 409:
                metrics.JIT_MINTS.labels(*self.key, "SecretWriteFailed").inc()
                text = f"JIT Secret {m.secret} could not be written (HTTP {e.status.code})"
                return ActsDone(secret_write_failed=text)
        metrics.JIT_MINTS.labels(*self.key, "ok").inc()
        await self._record(m.vm, m.secret)
        runner = ImpVMStatus(runner=RunnerStatus(id=jit.runner_id, name=jit.runner_name))
        await self.patch_vm_status(m.vm, runner)
        return None

    async def _runner_group(self, org: str, name: str | None) -> int:
        """The org runner group id (paginated lookup), cached per pool for
        ``runner_group_ttl`` seconds: every JIT config needs it and it rarely changes."""
        slot, mono = self.ctx.pool(self.key), self.world.mono
        cached = slot.runner_group
        if cached and cached[0] == (org, name) and mono < cached[2]:
            return cached[1]
        assert self.gh is not None
        gid = await self.gh.runner_group_id(org, name)
        slot.runner_group = ((org, name), gid, mono + self.ctx.settings.runner_group_ttl)
        return gid

    async def _record(self, vm: str, secret: str) -> None:
        """Record the JIT Secret's name in the VM's ``spec.runnerConfigSecret``."""
        patch = {"spec": {"runnerConfigSecret": secret}}
        await self.vm_written(
            self.kube.patch(ImpVMResource, vm, patch, namespace=self.ns, patch_type=MERGE)
        )
