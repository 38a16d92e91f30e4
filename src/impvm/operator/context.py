"""Process-wide state of the operator: the Kubernetes client, the GitHub provider, the clock, the
job tables, the pollers and JIT mint budgets of each installation, and one slot per pool (its
wake-up event and the memory its last pass concluded). Everything here is a cache: after a
restart it is rebuilt from Kubernetes objects and GitHub (Kubernetes is the database)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Secret

from impvm.api.models import AGENT_LEASE_NAMESPACE, PoolKey
from impvm.api.times import Clock, as_clock
from impvm.github import GitHubClient, RetryPolicy
from impvm.kube.events import EventRecorder
from impvm.operator.credentials import GitHubProvider
from impvm.operator.kubesource import KubeSource
from impvm.operator.poller import Pollers
from impvm.operator.runners import RunnerDirectory
from impvm.operator.scheduler import Scheduler
from impvm.operator.sources import CachedSource
from impvm.operator.vmpods import PodScheduler
from impvm.scaling.jobs import PoolScope
from impvm.scaling.jobtable import JobTable, JobTables
from impvm.scaling.mintbudget import MintBudget
from impvm.scaling.poolpass import PoolMemory
from impvm.scaling.settings import PassSettings, VMPodSettings


@dataclass
class PoolSlot:
    """One pool in this process: ``wake`` (its loop runs now rather than at its next tick) and
    ``memory``, the frozen value its last pass concluded (replaced whole, never changed in
    place). The webhook receiver and wake-ups read the pool's route from it."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    memory: PoolMemory = field(default_factory=PoolMemory)
    #: the executor's cache of the org runner group id: ((org, group), id, until (monotonic s))
    runner_group: tuple[tuple[str, str | None], int, float] | None = None

    @property
    def scope(self) -> PoolScope | None:
        """The pool as job routing sees it (None before its template and class were found)."""
        return self.memory.route.scope

    @property
    def webhook_secret(self) -> str | None:
        """Its webhook secret (webhook and hybrid modes)."""
        return self.memory.route.webhook_secret

    @property
    def prefix(self) -> str:
        """Name prefix of its runners."""
        return self.memory.route.prefix


@dataclass(frozen=True)
class OperatorSettings:
    """The operator's settings: ``pool``, the pool controller's tunables (the object its pass
    reads, :class:`~impvm.scaling.settings.PassSettings`), and what only the process needs
    (seconds unless named otherwise)."""

    pool: PassSettings = field(default_factory=PassSettings)
    github_api_url: str | None = None  # override (the stand-in); else from platform.serverURL
    github_timeout: float = 15.0
    github_retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(max_transient_retries=2, base_delay=0.5, max_delay=5.0)
    )
    #: seconds a resolved runner-group id is reused
    runner_group_ttl: float = 300.0
    #: the installation's own namespace (the chart's release namespace), where the leader Lease
    #: and the agents' Leases (the agents' ``--lease-namespace``) live: agent Leases are read
    #: there only, a Lease elsewhere is a tenant's
    lease_namespace: str = AGENT_LEASE_NAMESPACE
    #: leader election: on (replicas > 1 safe) or off (one replica only); the Lease's name and
    #: duration; the URL this replica receives webhooks at (written on the Lease while it leads,
    #: for standbys to forward to)
    leader_elect: bool = True
    leader_lease_name: str = "impvm-operator"
    leader_lease_seconds: float = 15.0
    advertise_url: str = ""
    #: usernames of the agents' ServiceAccounts, the only callers given JIT configs
    agent_service_accounts: tuple[str, ...] = (
        f"system:serviceaccount:{AGENT_LEASE_NAMESPACE}:impvm-agent",
    )
    #: VM pods (``--vm-pods``): place VMs through the Kubernetes scheduler
    #: (:mod:`impvm.operator.vmpods`); None: the operator's own placement
    vm_pods: VMPodSettings | None = None


class OperatorContext:
    """Shared by every handler of one operator process. ``clock``: a :class:`Clock`, or a
    monotonic function from which wall time is derived (tests move both at once)."""

    def __init__(
        self,
        kube: AsyncClient,
        settings: OperatorSettings | None = None,
        clock: Clock | Callable[[], float] | None = None,
    ) -> None:
        self.kube = kube
        self.settings = settings or OperatorSettings()
        #: the fencing check (leader election): False from the moment this replica may no
        #: longer act as leader; checked before every JIT mint
        self.leading: Callable[[], bool] = lambda: True
        self.clock = as_clock(clock)
        self.pools: dict[PoolKey, PoolSlot] = {}
        #: one job table per installation (:class:`JobTables`)
        self.jobs = JobTables()
        #: one job poller per credential identity, shared by the pools holding that key
        self.pollers = Pollers(
            self.jobs,
            self.clock,
            self.settings.pool.poll_budget(),
            self.scopes,
            wake=self.wake_known,
        )
        self.events = EventRecorder(kube, component="impvm-operator")
        self.sources: KubeSource = KubeSource(kube, self.settings.lease_namespace)
        #: the placement of unbound ImpVMs (made with the caches it reads)
        self.scheduler: Scheduler | None = None
        #: GitHub's runner registrations, one shared list per installation and scope
        self.runners = RunnerDirectory()
        #: each installation's JIT mint budget, shared by its pools
        self._mints: dict[GitHubClient, MintBudget] = {}
        s = self.settings
        self.github = GitHubProvider(
            kube,
            api_url=s.github_api_url,
            timeout=s.github_timeout,
            retry=s.github_retry,
            secrets=lambda ns, name: self.sources.get(Secret, name, ns),
            on_retire=self._retired,
        )

    def _retired(self, client: GitHubClient) -> None:
        """A client no Secret uses any more (a rotated key): its poller, lists and mint budget
        go."""
        self.pollers.forget(client)
        self.runners.forget_client(client)
        self._mints.pop(client, None)

    def use_caches(self, namespaces: list[str] | None = None) -> CachedSource:
        """Read from watch caches (started by the caller: ``await ctx.sources.start()``) whose
        changes wake the pools concerned. ``namespaces``: those watched (empty: all)."""
        cached = CachedSource(
            self.kube,
            namespaces,
            on_vm=lambda ns, pool: self.wake_known(PoolKey(ns, pool)),
            on_template=lambda ns, name: self.wake_using(ns, name, None),
            on_class=self._class_changed,
            on_pool=lambda ns, name: self.wake_known(PoolKey(ns, name)),
            lease_namespace=self.settings.lease_namespace,
        )
        self.sources = cached
        s = self.settings
        if s.vm_pods is not None:
            self.scheduler = PodScheduler(
                self.kube,
                cached,
                self.events,
                s.vm_pods,
                s.lease_namespace,
                s.pool.node_lost_grace_seconds,
                namespaces,
                leading=lambda: self.leading(),
            )
        else:
            self.scheduler = Scheduler(
                self.kube, cached, self.events, namespaces, leading=lambda: self.leading()
            )
        cached.on_lease = self.scheduler.wake
        return cached

    def _class_changed(self, _: str, name: str) -> None:
        """A class changed: the pools using it, and the placement (its size may fit now)."""
        self.wake_using(None, None, name)
        if self.scheduler is not None:
            self.scheduler.wake()

    def pool(self, key: PoolKey | tuple[str, str]) -> PoolSlot:
        """The slot of one pool (made on first use)."""
        key = PoolKey(*key)
        slot = self.pools.get(key)
        if slot is None:
            slot = self.pools[key] = PoolSlot()
        return slot

    def mint_budget(self, client: GitHubClient) -> MintBudget:
        """The JIT mint budget of ``client``'s installation (made on first use)."""
        budget = self._mints.get(client)
        if budget is None:
            s = self.settings.pool
            budget = self._mints[client] = MintBudget(
                per_minute=s.installation_mints_per_minute, pool_share=s.pool_mint_share
            )
        return budget

    def scopes(self) -> list[PoolScope]:
        """Every known pool as job routing sees it."""
        return [m.scope for m in self.pools.values() if m.scope is not None]

    def jobs_of(self, key: PoolKey) -> JobTable | None:
        """The job table of the installation the pool's credentials are (None: GitHub has not
        accepted them yet, so no job is routed to it)."""
        scope = self.pool(key).scope
        return self.jobs.get(scope.installation if scope is not None else None)

    def wake(self, key: PoolKey) -> None:
        """Make the pool's reconcile loop run now rather than at its next tick."""
        self.pool(key).wake.set()

    def wake_known(self, key: PoolKey) -> None:
        """Wake the pool if this process runs passes for it (else nothing is remembered)."""
        slot = self.pools.get(PoolKey(*key))
        if slot is not None:
            slot.wake.set()

    def wake_using(self, namespace: str | None, template: str | None, vm_class: str | None) -> None:
        """Wake every pool whose last pass used ``template`` (in ``namespace``) or ``vm_class``
        (an edit may make its VMs outdated)."""
        for key, slot in self.pools.items():
            route = slot.memory.route
            if (
                template is not None and key.namespace == namespace and route.template == template
            ) or (vm_class is not None and route.vm_class == vm_class):
                slot.wake.set()

    def forget(self, key: PoolKey) -> PoolSlot | None:
        """A pool is gone: drop its slot and what was kept for it (its runner lists' marks,
        its share of the mint budgets)."""
        slot = self.pools.pop(PoolKey(*key), None)
        if slot is not None and slot.prefix:
            self.runners.forget(slot.prefix)
            for budget in self._mints.values():
                budget.forget(slot.prefix)
        return slot

    async def close(self) -> None:
        """Stop the watch caches; close every GitHub client."""
        await self.sources.close()
        await self.github.close()
