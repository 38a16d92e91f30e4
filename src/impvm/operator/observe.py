"""What a pool pass reads: the observer fills a frozen :class:`~impvm.scaling.poolpass.PoolWorld`
with the pool's memory as its last pass concluded it, and changes nothing (no memory, no
registration: the conclusion alone makes the next memory). Facts come from
:mod:`impvm.operator.sources` (Kubernetes, watch caches in the operator), the
:class:`~impvm.operator.credentials.GitHubProvider` (GitHub), the shared runner directory
(:mod:`impvm.operator.runners`), the job table and the installation's JIT mint budget.

The order matters: template and class first, and the signing key the template requires
(without them nothing else is read), then GitHub's registrations **before** the VMs (a JIT
registration is made only after its VM exists, so every registration listed has its VM in the
cache: none is taken for an orphan), the pool's Secrets, the agents' Leases (only when a VM is
bound to a node or waits for one), and the job table's view."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

from lightkube.resources.core_v1 import Secret

from impvm.api.models import WEBHOOK_SECRET_KEY, PoolKey
from impvm.api.resources import ImpVMClassResource, ImpVMRunnerPoolResource, ImpVMTemplateResource
from impvm.api.vm import VM
from impvm.github import GitHubClient
from impvm.github.errors import GitHubError
from impvm.operator.context import OperatorContext
from impvm.operator.credentials import scope_of
from impvm.operator.execute import failure_of
from impvm.operator.verify import VerifyKeyError, secret_of, verify_key
from impvm.scaling.jobs import PoolScope
from impvm.scaling.labels import PoolLabels
from impvm.scaling.poolpass import (
    ClassObj,
    GitHubView,
    PollOutcome,
    PollRequest,
    PoolObj,
    PoolRoute,
    PoolWorld,
    RateBudget,
    RunnerView,
    TemplateObj,
    waiting_for_a_node,
)
from impvm.scaling.runnerlist import max_list_age

__all__ = ["PoolObserver"]

P = TypeVar("P")


class PoolObserver:
    """Reads the world of one pool's pass (see the module docstring)."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        #: parsed pools, templates and classes by (kind, namespace, name), with the
        #: (uid, resourceVersion) they were parsed from
        self.parsed: dict[tuple[str, str, str], tuple[tuple[Any, Any], object]] = {}

    async def pool(self, key: PoolKey, uid: str | None) -> PoolObj | None:
        """The pool to pass over, or None when it is gone or being deleted (``uid``: the pool
        object the caller runs for, when it knows it; another of the same name is not it)."""
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
        return self._parsed("pool", body, PoolObj.from_body)

    async def observe(self, pool: PoolObj) -> tuple[PoolWorld, GitHubClient | None]:
        """The world of one pass over ``pool`` and the pool's GitHub client (None when its
        credentials cannot be used or nothing needs GitHub)."""
        ctx, src = self.ctx, self.ctx.sources
        route = PoolRoute(template=pool.spec.template_name, prefix=pool.prefix)
        world = PoolWorld(
            pool=pool,
            now=ctx.clock.now(),
            mono=ctx.clock.monotonic(),
            jitter=random.random(),
            settings=ctx.settings.pool,
            memory=ctx.pool(pool.key).memory,
            route=route,
        )
        t = await src.get(ImpVMTemplateResource, pool.spec.template_name, pool.namespace)
        template = self._parsed("template", t, TemplateObj.from_body) if t else None
        if template is None:
            return world, None
        world = replace(world, template=template)
        route = replace(route, vm_class=template.spec.class_ref.name)
        c = await src.get(ImpVMClassResource, template.spec.class_ref.name, None)
        if c is None:
            return replace(world, route=route), None
        vm_class = self._parsed("class", c, ClassObj.from_body)
        world = replace(world, vm_class=vm_class, route=route)
        world = replace(world, class_denied=await self._class_denied(pool, vm_class))
        try:
            key_secret = secret_of(template.spec)
            body = await src.get(Secret, key_secret, pool.namespace) if key_secret else None
            world = replace(world, verify_key=verify_key(pool.namespace, template.spec, body))
        except VerifyKeyError as e:
            return replace(world, verify_key_problem=str(e)), None
        route, missing = await self._route(pool, route)
        # how old a runner list may be depends on the VMs; the VMs decided from are read after
        # the list (ordering: every registration listed then has its VM in the cache)
        max_age = max_list_age(await src.vms(pool), world.now, world.settings)
        github, view = await self._github(pool, world, max_age)
        route = _routed_as(route, github)
        vms = await src.vms(pool)
        # Leases matter for VMs on nodes (lost nodes) and VMs no node took (Unschedulable)
        needs = any(v.node_name for v in vms) or waiting_for_a_node(replace(world, vms=vms))
        world = replace(
            world,
            vms=vms,
            secrets=await src.secret_names(pool),
            leases=await src.leases() if needs else (),
            github=view,
            webhook_secret_missing=missing,
            route=route,
        )
        return self.jobs(world, vms), github

    async def _class_denied(self, pool: PoolObj, vm_class: ClassObj) -> str | None:
        """Why the pool's namespace may not use its class (the class's ``spec.namespaces``;
        the API server refuses new templates and VMs of it there, a class narrowed later stops
        the pool here), or None. The namespace's labels are read only for a class that selects
        namespaces."""
        rule = vm_class.spec.namespaces
        if rule is None or rule.from_ == "All":
            return None
        labels = await self.ctx.sources.namespace_labels(pool.namespace)
        if labels is not None and vm_class.spec.admits(labels):
            return None
        return (
            f"ImpVMClass {vm_class.name!r} may not be used in namespace {pool.namespace!r} "
            "(its spec.namespaces does not select it): no VM is made"
        )

    async def _route(self, pool: PoolObj, route: PoolRoute) -> tuple[PoolRoute, str | None]:
        """The pool's route with its job routing scope and webhook secret (webhook and hybrid
        modes), and the webhook Secret's name when it is missing (deliveries for the pool are
        then refused with 401)."""
        spec = pool.spec
        labels = PoolLabels(
            namespace=pool.namespace,
            name=pool.name,
            labels=tuple(spec.labels),
            created=pool.created,
            uid=pool.uid,
        )
        # the installation GitHub proved for the pool's key stays until this pass's client
        # says otherwise (:func:`_routed_as`)
        old = self.ctx.pool(pool.key).scope
        scope = PoolScope(
            key=labels,
            org=spec.platform.scope.org,
            repo=spec.platform.scope.repo,
            installation=old.installation if old is not None else None,
            installation_id=old.installation_id if old is not None else None,
            prefix=pool.prefix,
            takes_jobs=spec.scaling is not None and spec.scaling.mode != "manual",
        )
        route = replace(route, scope=scope)
        scaling = spec.scaling
        ref = scaling.webhook.secret_ref if scaling and scaling.webhook else None
        if ref is None or scaling is None or scaling.mode not in ("webhook", "hybrid"):
            return route, None
        sec = await self.ctx.sources.get(Secret, ref.name, pool.namespace)
        raw = ((sec or {}).get("data") or {}).get(WEBHOOK_SECRET_KEY)
        secret = base64.b64decode(raw).decode() if raw else None
        return replace(route, webhook_secret=secret), ref.name if sec is None else None

    async def _github(
        self, pool: PoolObj, world: PoolWorld, max_age: float
    ) -> tuple[GitHubClient | None, GitHubView]:
        """The pool's client and its registrations from the shared runner directory, from a
        list at most ``max_age`` seconds old (no call at all while backing off), the rate-limit
        budget and the pool's JIT mint allowance."""
        try:
            client = await self.ctx.github.client(pool.namespace, pool.spec.platform)
        except GitHubError as e:
            return None, GitHubView(failure=failure_of(e))
        allowance = self.ctx.mint_budget(client).allowance(pool.prefix, world.mono)
        if not world.memory.backoff.ready(world.mono):
            return client, GitHubView(connected=True, skipped=True, mint_allowance=allowance)
        scope = scope_of(pool.spec.platform)
        view = GitHubView(connected=True, mint_allowance=allowance)
        try:
            found = await self.ctx.runners.runners(client, scope, pool.prefix, max_age, world.mono)
        except GitHubError as e:
            view = replace(view, failure=failure_of(e))
        else:
            runners = tuple(
                RunnerView(id=r.id, name=r.name, online=r.status == "online", busy=r.busy)
                for r in found
            )
            view = replace(view, runners=runners)
        return client, replace(view, budget=await self._budget(pool, client))

    async def _budget(self, pool: PoolObj, client: GitHubClient) -> RateBudget | None:
        """The client's core rate limit as last reported, and whose it is."""
        b = client.rate_budget()
        if b is None:
            return None
        return RateBudget(
            limit=b.limit,
            remaining=b.remaining,
            reset=b.reset,
            installation=await self._installation(pool, client),
        )

    async def _installation(self, pool: PoolObj, client: GitHubClient) -> str:
        """A name of the pool's installation without secrets: the API host with the App and
        installation ids of its credentials Secret, or the Secret itself for a token (its rate
        limit is its user's)."""
        platform = pool.spec.platform
        host = client.api_url.split("://", 1)[-1].rstrip("/")
        sec = await self.ctx.sources.get(Secret, platform.credentials_secret, pool.namespace)
        data = (sec or {}).get("data") or {}

        def value(key: str) -> str:
            raw = data.get(key)
            return base64.b64decode(raw).decode(errors="replace").strip() if raw else ""

        app, inst = value("github_app_id"), value("github_app_installation_id")
        if platform.token_source != "pat" and app.isdigit() and inst.isdigit():
            return f"{host} app {app} installation {inst}"
        return f"{host} token {pool.namespace}/{platform.credentials_secret}"

    def jobs(self, world: PoolWorld, vms: tuple[VM, ...]) -> PoolWorld:
        """``world`` with the job table's view: queued jobs routed to the pool, jobs in
        progress on and finished by its runners, the arrivals since the warm pool's cursor. The
        pool is routed as this pass sees it, beside the others as their last pass left them."""
        route = world.route
        if route is None or route.scope is None:
            return world
        key = world.pool.key
        others = [s.scope for k, s in self.ctx.pools.items() if k != key and s.scope is not None]
        scopes = [*others, route.scope]
        table, names = self.ctx.jobs.get(route.scope.installation), [v.name for v in vms]
        cursor = world.memory.warm.cursor
        if table is None:  # GitHub has not accepted the pool's credentials: no job is its
            return replace(world, arrivals_read=self.ctx.jobs.last_arrival)
        return replace(
            world,
            pending_jobs=table.pending(route.scope.key, scopes),
            running_jobs=table.running_on(names),
            finished_jobs=table.finished_on(names),
            arrivals=tuple(table.arrivals(route.scope.key, scopes, cursor)),
            arrivals_read=self.ctx.jobs.last_arrival,
        )

    async def poll(self, world: PoolWorld, github: GitHubClient, ask: PollRequest) -> PoolWorld:
        """The first phase's answer: ask the installation's poller (:mod:`impvm.operator.poller`)
        for a poll of the pool's scope that started at ``ask.since`` or later (it fills the job
        table and sweeps stale jobs); returns the world with that poll's outcome and the job
        table read again."""
        scope = scope_of(world.pool.spec.platform)
        poller = self.ctx.pollers.of(github)
        key = PoolKey(world.pool.namespace, world.pool.name)
        report = await poller.poll(scope, ask.since, key)
        outcome = PollOutcome(time=report.finished_at, started=report.started, swept=report.swept)
        if report.failure is not None:
            outcome = replace(outcome, failure=failure_of(report.failure))
        else:
            outcome = replace(outcome, queued=poller.queued(scope), api_calls=report.api_calls)
        return world.after_poll(outcome, self.jobs(world, world.vms), ask.vanished)

    def _parsed(self, kind: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], P]) -> P:
        """``parse(body)``, reused while the object's uid and resourceVersion stay the same (the
        caches hand out the same object until it changes; validating it once per pass was a
        tenth of an idle operator's time)."""
        meta = body.get("metadata") or {}
        key = (kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        version = (meta.get("uid"), meta.get("resourceVersion"))
        found = self.parsed.get(key)
        if found is not None and found[0] == version and version[1]:
            return cast(P, found[1])
        value = parse(body)
        self.parsed[key] = (version, value)
        return value


def _routed_as(route: PoolRoute, github: GitHubClient | None) -> PoolRoute:
    """Route to the pool the jobs of its credentials' installation, once GitHub accepted them
    (:attr:`GitHubClient.installation`); none while it has not (a Secret naming another
    tenant's App ID and installation ID with a key of its own never gets there)."""
    if route.scope is None:
        return route
    proven = github.installation if github is not None else None
    ident = github.identity.installation_id if proven and github is not None else None
    return replace(route, scope=replace(route.scope, installation=proven, installation_id=ident))
