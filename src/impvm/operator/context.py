"""Process-wide state of the operator: the Kubernetes client, GitHub clients per credentials
Secret, per-pool wake-up events and backoff. Everything here is a cache: after a restart it is
rebuilt from Kubernetes objects and GitHub (DESIGN.md: Kubernetes is the database)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lightkube import AsyncClient

from impvm.events import EventRecorder
from impvm.github import GitHubClient, RetryPolicy
from impvm.scaling.jobtable import JobTable, PoolScope

PoolKey = tuple[str, str]  # (namespace, name)


@dataclass
class Backoff:
    """Exponential backoff with full jitter for one pool's GitHub-dependent work (seconds)."""

    base: float = 2.0
    cap: float = 300.0
    failures: int = 0
    not_before: float = 0.0

    def failed(self, now: float, at_least: float = 0.0) -> float:
        """Record a failure; return the delay before the next try."""
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** (self.failures - 1))
        delay = float(max(at_least, delay * (0.5 + random.random() / 2)))
        self.not_before = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.not_before = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.not_before


@dataclass
class PoolMemory:
    """In-memory facts about one pool between passes (all re-derivable)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    github_backoff: Backoff = field(default_factory=Backoff)
    last_poll: float = 0.0
    queued_jobs: int = 0
    #: runners busy at the last poll: when this changes a queued job was taken, so re-poll
    busy_at_poll: frozenset[str] = frozenset()
    #: ((org, group name), group id, valid until) of the last runner-group lookup
    runner_group: tuple[tuple[str, str | None], int, float] | None = None
    #: the pool as job routing sees it, and its webhook secret (webhook/hybrid modes)
    scope: PoolScope | None = None
    webhook_secret: str | None = field(default=None, repr=False)
    last_error: str = ""


@dataclass
class OperatorSettings:
    """Tunables (seconds)."""

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
    #: seconds between the reconciliation polls of a webhook-mode pool
    webhook_resync_seconds: float = 300.0
    #: seconds a resolved runner-group id is reused
    runner_group_ttl: float = 300.0
    #: seconds past an agent Lease's duration before its node's VMs are given up
    node_lost_grace_seconds: float = 60.0


@dataclass
class _ClientEntry:
    fingerprint: str
    client: GitHubClient


class OperatorContext:
    """Shared by every handler of one operator process."""

    def __init__(
        self,
        kube: AsyncClient,
        settings: OperatorSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings or OperatorSettings()
        self.clock = clock
        self.pools: dict[PoolKey, PoolMemory] = {}
        self.jobs = JobTable()
        self.events = EventRecorder(kube, component="impvm-operator")
        self._github: dict[tuple[str, str], _ClientEntry] = {}

    def pool(self, key: PoolKey) -> PoolMemory:
        """Memory of one pool (created on first use)."""
        mem = self.pools.get(key)
        if mem is None:
            mem = self.pools[key] = PoolMemory()
        return mem

    def scopes(self) -> list[PoolScope]:
        """Every known pool as job routing sees it."""
        return [m.scope for m in self.pools.values() if m.scope is not None]

    def forget(self, key: PoolKey) -> None:
        """Drop a deleted pool (its jobs route elsewhere or count as unmatched)."""
        self.pools.pop(key, None)

    def wake(self, key: PoolKey) -> None:
        """Make the pool's reconcile loop run now rather than at its next tick."""
        self.pool(key).wake.set()

    def github_client(
        self, namespace: str, secret: str, fingerprint: str, make: Callable[[], GitHubClient]
    ) -> GitHubClient:
        """The cached client for a credentials Secret; a new one when the Secret changed
        (``fingerprint`` is its resourceVersion plus the pool's server URL)."""
        key = (namespace, secret)
        entry = self._github.get(key)
        if entry is None or entry.fingerprint != fingerprint:
            entry = self._github[key] = _ClientEntry(fingerprint, make())
        return entry.client

    async def close(self) -> None:
        """Close every GitHub client."""
        for e in self._github.values():
            await e.client.close()
        self._github.clear()
