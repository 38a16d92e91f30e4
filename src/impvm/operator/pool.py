"""The pool controller's shell: observe a :class:`~impvm.scaling.world.PoolWorld`, decide
(:func:`impvm.scaling.poolpass.decide`), carry the plan out
(:class:`~impvm.operator.execute.PlanExecutor`), settle, write the status and Events.

Every decision is in :mod:`impvm.scaling.poolpass`. Facts come from :mod:`impvm.operator.sources`
(Kubernetes, watch caches in the operator), :class:`~impvm.operator.credentials.GitHubProvider`
(GitHub), the shared runner directory (:mod:`impvm.operator.runners`) and the job table.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

from lightkube.resources.core_v1 import Secret

from impvm.api.models import WEBHOOK_SECRET_KEY, PoolKey
from impvm.api.resources import ImpVMClassResource, ImpVMRunnerPoolResource, ImpVMTemplateResource
from impvm.github import GitHubClient
from impvm.github.errors import GitHubError
from impvm.operator.context import OperatorContext, PoolMemory
from impvm.operator.credentials import scope_of
from impvm.operator.execute import PlanExecutor, failure_of
from impvm.operator.metrics import record_pool
from impvm.operator.verify import VerifyKeyError, secret_of, verify_key
from impvm.scaling import timings
from impvm.scaling.jobtable import Job, PoolScope
from impvm.scaling.labels import PoolLabels
from impvm.scaling.names import runner_prefix, secret_name
from impvm.scaling.pool import RunnerView
from impvm.scaling.poolpass import decide, settle, waiting_for_a_node
from impvm.scaling.runnerlist import max_list_age
from impvm.scaling.world import (
    ClassObj,
    GitHubView,
    PollOutcome,
    PoolObj,
    PoolWorld,
    RateBudget,
    TemplateObj,
    VMObj,
)

__all__ = ["PoolReconciler", "runner_prefix", "secret_name"]

log = logging.getLogger("impvm.operator.pool")
P = TypeVar("P")


class PoolReconciler:
    """Reconciles one pool per :meth:`reconcile` call. Stateless but for ``ctx`` caches."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    async def reconcile(
        self, key: PoolKey | tuple[str, str], uid: str | None = None
    ) -> float | None:
        """One pass over pool ``key`` (``uid``: the pool object the caller runs for, when it
        knows it). Returns seconds until the next pass (None: pool gone)."""
        key = PoolKey(*key)
        src = self.ctx.sources
        body = await src.get(ImpVMRunnerPoolResource, key.name, key.namespace)
        stale = body is not None and uid is not None and body["metadata"].get("uid") != uid
        if body is None or stale or body["metadata"].get("deletionTimestamp"):
            # ending the pool's loop is for good: decide it from the API server, never from a
            # cache that may not have seen a pool just created (or created again under the
            # same name while the old one was still being deleted)
            body = await src.api_get(ImpVMRunnerPoolResource, key.name, key.namespace)
            if body is not None and uid is not None and body["metadata"].get("uid") != uid:
                return None  # the caller's pool is gone; a new one of that name has its own loop
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        world, github = await self._observe(_parsed(self.ctx.pool(key), body, PoolObj.from_body))
        world = self._arrivals(world)
        plan = decide(world)
        if plan.poll is not None and github is not None:
            world = self._arrivals(await self._poll(world, github, plan.poll.since))
            plan = decide(world)
        log.debug(
            "pool %s/%s: %d acts: %s", *key, plan.acts, plan.sizing and plan.sizing.create_reason
        )
        mem = self.ctx.pool(key)
        if plan.settlement is not None:  # kept even if an act raises: failures seen so far
            mem.backoff, mem.poll = plan.settlement.backoff, plan.settlement.poll
        act = PlanExecutor(self.ctx, world, github)
        outcome = await act.run(plan)
        done = settle(world, plan, outcome)
        mem.backoff, mem.poll = done.backoff, done.poll
        for event in done.events:
            await act.event(event)
        if done.write:
            await act.write_status(done.status, done.conditions)
        if done.warm is not None:  # only once written: else the next pass folds them again
            mem.warm = done.warm
        if done.counts is not None:
            record_pool(key, done.counts, outcome.created)
        return done.requeue

    async def _observe(self, pool: PoolObj) -> tuple[PoolWorld, GitHubClient | None]:
        """Read what the pass decides from: template and class first, and the signing key the
        template requires (without them nothing else is read), then GitHub's registrations
        before the VMs (see :mod:`impvm.scaling.pool`: no registration is then taken for an
        orphan), the pool's Secrets, the agents' Leases (only when a VM is bound to a node) and
        the job table."""
        ctx, mem, src = self.ctx, self.ctx.pool(pool.key), self.ctx.sources
        mem.template = pool.spec.template_name
        world = PoolWorld(
            pool=pool,
            now=ctx.clock.now(),
            mono=ctx.clock.monotonic(),
            jitter=random.random(),
            settings=ctx.settings.for_pass(),
            backoff=mem.backoff,
            poll=mem.poll,
            warm=mem.warm,
        )
        t = await src.get(ImpVMTemplateResource, pool.spec.template_name, pool.namespace)
        template = _parsed(mem, t, TemplateObj.from_body) if t else None
        if template is None:
            return world, None
        mem.vm_class = template.spec.class_ref.name
        c = await src.get(ImpVMClassResource, mem.vm_class, None)
        if c is None:
            return replace(world, template=template), None
        try:
            key_secret = secret_of(template.spec)
            body = await src.get(Secret, key_secret, pool.namespace) if key_secret else None
            verify = verify_key(pool.namespace, template.spec, body)
        except VerifyKeyError as e:
            problem = replace(
                world, template=template, vm_class=_parsed(mem, c, ClassObj.from_body)
            )
            return replace(problem, verify_key_problem=str(e)), None
        missing = await self._register(pool)
        # how old a runner list may be depends on the VMs; the VMs decided from are read after
        # the list (ordering: every registration listed then has its VM in the cache)
        max_age = max_list_age(await src.vms(pool), world.now, world.settings)
        github, view = await self._github(pool, world, max_age)
        vms = await src.vms(pool)
        # Leases matter for VMs on nodes (lost nodes) and VMs no node took (Unschedulable)
        needs = any(v.spec.node_name for v in vms) or waiting_for_a_node(replace(world, vms=vms))
        leases = await src.leases() if needs else ()
        mem.timings = timings.observe(mem.timings, vms, world.now)
        pending, running = self._jobs(pool, vms)
        return replace(
            world,
            template=template,
            vm_class=_parsed(mem, c, ClassObj.from_body),
            verify_key=verify,
            vms=vms,
            secrets=await src.secret_names(pool),
            leases=leases,
            timings=timings.summary(mem.timings),
            github=view,
            pending_jobs=pending,
            running_jobs=running,
            webhook_secret_missing=missing,
        ), github

    async def _register(self, pool: PoolObj) -> str | None:
        """Tell job routing and the webhook receiver about this pool (labels, scope, webhook
        secret). Returns the webhook Secret's name when it is missing (deliveries for the pool
        are then refused with 401)."""
        mem, spec = self.ctx.pool(pool.key), pool.spec
        route = PoolLabels(namespace=pool.namespace, name=pool.name, labels=tuple(spec.labels))
        mem.scope = PoolScope(key=route, org=spec.platform.scope.org, repo=spec.platform.scope.repo)
        mem.prefix = pool.prefix
        scaling = spec.scaling
        ref = scaling.webhook.secret_ref if scaling and scaling.webhook else None
        if ref is None or scaling is None or scaling.mode not in ("webhook", "hybrid"):
            mem.webhook_secret = None
            return None
        # replaced in one step: a delivery arriving while the Secret is read still verifies
        sec = await self.ctx.sources.get(Secret, ref.name, pool.namespace)
        raw = ((sec or {}).get("data") or {}).get(WEBHOOK_SECRET_KEY)
        mem.webhook_secret = base64.b64decode(raw).decode() if raw else None
        return ref.name if sec is None else None

    async def _github(
        self, pool: PoolObj, world: PoolWorld, max_age: float
    ) -> tuple[GitHubClient | None, GitHubView]:
        """The pool's client and its registrations from the shared runner directory, from a
        list at most ``max_age`` seconds old (no call at all while backing off)."""
        try:
            client = await self.ctx.github.client(pool.namespace, pool.spec.platform)
        except GitHubError as e:
            return None, GitHubView(failure=failure_of(e))
        if not world.backoff.ready(world.mono):
            return client, GitHubView(connected=True, skipped=True)
        scope = scope_of(pool.spec.platform)
        try:
            found = await self.ctx.runners.runners(client, scope, pool.prefix, max_age, world.mono)
        except GitHubError as e:
            return client, GitHubView(connected=True, failure=failure_of(e), budget=_budget(client))
        runners = tuple(
            RunnerView(id=r.id, name=r.name, online=r.status == "online", busy=r.busy)
            for r in found
        )
        return client, GitHubView(connected=True, runners=runners, budget=_budget(client))

    def _jobs(self, pool: PoolObj, vms: tuple[VMObj, ...]) -> tuple[int, dict[str, Job]]:
        """Queued jobs routed to the pool, and in-progress jobs by runner name."""
        scope = self.ctx.pool(pool.key).scope
        assert scope is not None
        pending = self.ctx.jobs.pending(scope.key, self.ctx.scopes())
        return pending, self.ctx.jobs.running_on(v.name for v in vms)

    def _arrivals(self, world: PoolWorld) -> PoolWorld:
        """``world`` with the job table's arrivals for the pool since the warm pool's cursor."""
        scope = self.ctx.pool(world.pool.key).scope
        if scope is None:  # not registered yet: the template or class is missing
            return world
        jobs, cursor = self.ctx.jobs, world.warm.cursor
        read = jobs.last_arrival
        found = tuple(jobs.arrivals(scope.key, self.ctx.scopes(), cursor))
        return replace(world, arrivals=found, arrivals_read=read)

    async def _poll(self, world: PoolWorld, github: GitHubClient, since: float | None) -> PoolWorld:
        """Ask the installation's poller (:mod:`impvm.operator.poller`) for a poll of the
        pool's scope that started at ``since`` or later (it fills the job table and sweeps
        stale jobs); returns the world with that poll's outcome and the job table re-read."""
        scope = scope_of(world.pool.spec.platform)
        poller = self.ctx.pollers.of(github)
        report = await poller.poll(scope, since)
        if report.failure is not None:
            outcome = PollOutcome(
                time=report.finished_at,
                failure=failure_of(report.failure),
                started=report.started,
                swept=report.swept,
            )
        else:
            outcome = PollOutcome(
                time=report.finished_at,
                queued=poller.queued(scope),
                api_calls=report.api_calls,
                started=report.started,
                swept=report.swept,
            )
        return world.after_poll(outcome, *self._jobs(world.pool, world.vms))


def _parsed(mem: PoolMemory, body: dict[str, Any], parse: Callable[[dict[str, Any]], P]) -> P:
    """``parse(body)``, reused while the object's uid and resourceVersion stay the same (the
    caches hand out the same object until it changes; validating it once per pass was a tenth
    of an idle operator's time)."""
    meta = body.get("metadata") or {}
    key = (parse, meta.get("uid"), meta.get("resourceVersion"))
    kind = getattr(parse, "__qualname__", "")
    found = mem.parsed.get(kind)
    if found is not None and found[0] == key and key[2]:
        return cast(P, found[1])
    value = parse(body)
    mem.parsed[kind] = (key, value)
    return value


def _budget(client: GitHubClient) -> RateBudget | None:
    b = client.rate_budget()
    return RateBudget(limit=b.limit, remaining=b.remaining, reset=b.reset) if b else None
