"""Process-wide state of the operator: the Kubernetes client, the GitHub provider, the clock, the
job table and per-pool memory (wake-up events, backoff, poll state). Everything here is a cache:
after a restart it is rebuilt from Kubernetes objects and GitHub (Kubernetes is the database)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Secret

from impvm.api.models import AGENT_LEASE_NAMESPACE, PoolKey
from impvm.api.times import Clock, as_clock
from impvm.events import EventRecorder
from impvm.github import RetryPolicy
from impvm.operator.credentials import GitHubProvider
from impvm.operator.poller import Pollers
from impvm.operator.runners import RunnerDirectory
from impvm.operator.sources import CachedSource, KubeSource
from impvm.scaling.jobtable import JobTable, PoolScope
from impvm.scaling.pollbudget import PollBudget
from impvm.scaling.timings import TimingWindow
from impvm.scaling.world import BackoffState, PassSettings, PollState, WarmPoolMemory


@dataclass
class PoolMemory:
    """In-memory facts about one pool between passes (all re-derivable)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    backoff: BackoffState = field(default_factory=BackoffState)
    poll: PollState = field(default_factory=PollState)
    #: ((org, group name), group id, valid until (monotonic s)) of the last runner-group lookup
    runner_group: tuple[tuple[str, str | None], int, float] | None = None
    #: the pool as job routing sees it, and its webhook secret (webhook/hybrid modes)
    scope: PoolScope | None = None
    webhook_secret: str | None = field(default=None, repr=False)
    #: name prefix of the pool's runners (:func:`impvm.scaling.names.runner_prefix`)
    prefix: str = ""
    #: template and class names of the last pass (an edit of either wakes the pool)
    template: str | None = None
    vm_class: str | None = None
    #: the pool's job timings of the last hour (:mod:`impvm.scaling.timings`)
    timings: TimingWindow = field(default_factory=TimingWindow)
    #: the warm pool's arrivals read, last state written and runners counted ready
    warm: WarmPoolMemory = field(default_factory=WarmPoolMemory)
    #: the pool's, its template's and its class's parsed objects, by parser, with the
    #: (parser, uid, resourceVersion) they were parsed from
    parsed: dict[str, tuple[tuple[object, ...], object]] = field(default_factory=dict)


@dataclass
class OperatorSettings:
    """Tunables (seconds unless named otherwise)."""

    resync_seconds: float = 10.0
    busy_resync_seconds: float = 2.0
    template_missing_requeue_seconds: float = 30.0
    github_api_url: str | None = None  # override (the stand-in); else from platform.serverURL
    github_timeout: float = 15.0
    github_retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(max_transient_retries=2, base_delay=0.5, max_delay=5.0)
    )
    #: below this share of the rate-limit budget, polling (non-essential) pauses; JIT minting
    #: (essential) goes on
    poll_budget_floor: float = 0.2
    #: seconds between the safety polls of a webhook-mode pool (lost deliveries)
    webhook_safety_poll_seconds: float = 300.0
    #: requests the job poller of one installation may make (:mod:`impvm.scaling.pollbudget`)
    poll_budget: PollBudget = field(default_factory=PollBudget)
    #: seconds a resolved runner-group id is reused
    runner_group_ttl: float = 300.0
    #: the oldest shared runner list a pool decides from while a VM awaits its runner, and
    #: otherwise; how long a new VM counts as awaiting it (:mod:`impvm.scaling.runnerlist`)
    awaiting_runner_list_seconds: float = 0.5
    idle_runner_list_seconds: float = 60.0
    runner_wait_fresh_seconds: float = 60.0
    #: seconds past an agent Lease's duration before its node's VMs are given up
    node_lost_grace_seconds: float = 60.0
    #: leader election: on (replicas > 1 safe) or off (one replica only); the Lease's name (in
    #: the agents' Lease namespace) and duration; the URL this replica receives webhooks at
    #: (written on the Lease while it leads, for standbys to forward to)
    leader_elect: bool = True
    leader_lease_name: str = "impvm-operator"
    leader_lease_seconds: float = 15.0
    advertise_url: str = ""
    #: usernames of the agents' ServiceAccounts, the only callers given JIT configs
    agent_service_accounts: tuple[str, ...] = (
        f"system:serviceaccount:{AGENT_LEASE_NAMESPACE}:impvm-agent",
    )

    def for_pass(self) -> PassSettings:
        """The tunables the pure pool pass reads."""
        return PassSettings(
            resync_seconds=self.resync_seconds,
            busy_resync_seconds=self.busy_resync_seconds,
            template_missing_requeue_seconds=self.template_missing_requeue_seconds,
            poll_budget_floor=self.poll_budget_floor,
            webhook_safety_poll_seconds=self.webhook_safety_poll_seconds,
            node_lost_grace_seconds=self.node_lost_grace_seconds,
            awaiting_runner_list_seconds=self.awaiting_runner_list_seconds,
            idle_runner_list_seconds=self.idle_runner_list_seconds,
            runner_wait_fresh_seconds=self.runner_wait_fresh_seconds,
        )


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
        self.pools: dict[PoolKey, PoolMemory] = {}
        self.jobs = JobTable()
        #: one job poller per installation, shared by its pools
        self.pollers = Pollers(self.jobs, self.clock, self.settings.poll_budget)
        self.events = EventRecorder(kube, component="impvm-operator")
        self.sources: KubeSource = KubeSource(kube)
        #: GitHub's runner registrations, one shared list per installation and scope
        self.runners = RunnerDirectory()
        s = self.settings
        self.github = GitHubProvider(
            kube,
            api_url=s.github_api_url,
            timeout=s.github_timeout,
            retry=s.github_retry,
            secrets=lambda ns, name: self.sources.get(Secret, name, ns),
        )

    def use_caches(self, namespaces: list[str] | None = None) -> CachedSource:
        """Read from watch caches (started by the caller: ``await ctx.sources.start()``) whose
        changes wake the pools concerned. ``namespaces``: those watched (empty: all)."""
        cached = CachedSource(
            self.kube,
            namespaces,
            on_vm=lambda ns, pool: self.wake_known(PoolKey(ns, pool)),
            on_template=lambda ns, name: self.wake_using(ns, name, None),
            on_class=lambda _, name: self.wake_using(None, None, name),
            on_pool=lambda ns, name: self.wake_known(PoolKey(ns, name)),
        )
        self.sources = cached
        return cached

    def pool(self, key: PoolKey) -> PoolMemory:
        """Memory of one pool (created on first use)."""
        key = PoolKey(*key)
        mem = self.pools.get(key)
        if mem is None:
            mem = self.pools[key] = PoolMemory()
        return mem

    def scopes(self) -> list[PoolScope]:
        """Every known pool as job routing sees it."""
        return [m.scope for m in self.pools.values() if m.scope is not None]

    def wake(self, key: PoolKey) -> None:
        """Make the pool's reconcile loop run now rather than at its next tick."""
        self.pool(key).wake.set()

    def wake_known(self, key: PoolKey) -> None:
        """Wake the pool if this process runs passes for it (else nothing is remembered)."""
        mem = self.pools.get(PoolKey(*key))
        if mem is not None:
            mem.wake.set()

    def wake_using(self, namespace: str | None, template: str | None, vm_class: str | None) -> None:
        """Wake every pool whose last pass used ``template`` (in ``namespace``) or ``vm_class``
        (an edit may make its VMs outdated)."""
        for key, mem in self.pools.items():
            if (
                template is not None and key.namespace == namespace and mem.template == template
            ) or (vm_class is not None and mem.vm_class == vm_class):
                mem.wake.set()

    async def close(self) -> None:
        """Stop the watch caches; close every GitHub client."""
        await self.sources.close()
        await self.github.close()
