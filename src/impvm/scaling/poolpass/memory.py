"""What a pool pass carries to the next one: one frozen :class:`PoolMemory` value. The observer
hands the last value to the pass inside the world; only the pass's conclusion
(:func:`impvm.scaling.poolpass.conclude_pass`) makes a new one, and the shell keeps it. All of
it is re-derivable: a restarted operator starts from the pool's status and its VMs. Pure.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from impvm.scaling.jobs import PoolScope
from impvm.scaling.timings import TimingWindow
from impvm.scaling.warmpool import WarmPoolState

__all__ = [
    "BackoffState",
    "PollState",
    "PoolMemory",
    "PoolRoute",
    "StartFailures",
    "WarmPoolMemory",
]


@dataclass(frozen=True, slots=True)
class BackoffState:
    """Exponential backoff with full jitter of a pool's GitHub work. ``not_before`` is
    monotonic seconds; ``last_error`` the message of the last failure."""

    failures: int = 0
    not_before: float = 0.0
    last_error: str = ""

    def ready(self, mono: float) -> bool:
        """Whether GitHub may be called at ``mono``."""
        return mono >= self.not_before

    def failed(
        self,
        mono: float,
        jitter: float,
        *,
        message: str,
        at_least: float = 0.0,
        base: float = 2.0,
        cap: float = 300.0,
    ) -> BackoffState:
        """After a failure at ``mono``: the next try waits ``min(cap, base * 2**(n-1))`` times
        ``0.5 + jitter / 2`` (``jitter`` in [0, 1)), and at least ``at_least`` seconds (a rate
        limit's reset)."""
        n = self.failures + 1
        delay = min(cap, base * 2 ** (n - 1)) * (0.5 + jitter / 2)
        return BackoffState(n, mono + max(at_least, delay), message)

    def succeeded(self) -> BackoffState:
        return BackoffState(0, 0.0, self.last_error)


@dataclass(frozen=True, slots=True)
class PollState:
    """When the poll that last answered the pool started (monotonic s; None: never), which of
    its runners were busy then (a change means a queued job was taken: poll again), whether
    every repository of the installation had been read once by then (a large organisation is
    read over several polls), and the runners whose vanished registration it was asked for
    (each is asked about once)."""

    last_poll: float | None = None
    busy_at_poll: frozenset[str] = frozenset()
    swept: bool = True
    vanished_at_poll: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmPoolMemory:
    """What the warm pool keeps between passes.

    - ``cursor``: job-table arrivals numbered up to it were folded in (never twice);
    - ``state``: the state the last pass wrote (used when a read of the pool lags behind it);
    - ``ready``: VMs whose runner was already counted ready (while their recorded runner
      still says otherwise).
    """

    cursor: int = 0
    state: WarmPoolState | None = None
    ready: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class StartFailures:
    """VMs of the pool's current template that failed at start, in a row (their runner never
    came online and took no job): the per-pool backoff on start failures.

    - ``template_hash``: the template they were made from (an edit starts afresh);
    - ``count``: consecutive failures; ``last_at``: when the last one ended;
    - ``last_vm``, ``last_reason``, ``last_code``: the last one's name, ``exitReason`` and
      ``exitCode``;
    - ``counted``: VMs already counted (each once).
    """

    template_hash: str = ""
    count: int = 0
    last_at: dt.datetime | None = None
    last_vm: str = ""
    last_reason: str = ""
    last_code: int | None = None
    counted: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolRoute:
    """The pool as the operator's job routing, webhook receiver and wake-ups know it:
    ``template``/``vm_class`` names (an edit of either wakes the pool), ``prefix`` of its runner
    names, and, once its template and class were found, its routing ``scope`` and webhook
    secret (webhook and hybrid modes)."""

    template: str | None = None
    vm_class: str | None = None
    prefix: str = ""
    scope: PoolScope | None = None
    webhook_secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolMemory:
    """One pool's memory between passes: GitHub backoff, poll state, warm pool, job timings
    of the last hour, start failures, and its route."""

    backoff: BackoffState = field(default_factory=BackoffState)
    poll: PollState = field(default_factory=PollState)
    warm: WarmPoolMemory = field(default_factory=WarmPoolMemory)
    timings: TimingWindow = field(default_factory=TimingWindow)
    starts: StartFailures = field(default_factory=StartFailures)
    route: PoolRoute = field(default_factory=PoolRoute)
