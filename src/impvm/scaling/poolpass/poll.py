"""The first phase of a pool pass: whether GitHub must be polled for the scope's jobs before the
pass decides (:func:`poll_first`). The shell then polls (the installation's poller), reads the
job table again and decides on that world (:func:`impvm.scaling.poolpass.pool_acts`). Pure.

A pool asks for a poll in polling/hybrid mode every ``polling.intervalSeconds``, sooner when a
runner became busy (a queued job was taken); in webhook mode once at start (an operator restart
loses no job; every ``resync_seconds`` until the installation's poller read every repository
once, as a large organisation takes several polls) and every ``webhook_safety_poll_seconds`` (a
queued job whose later deliveries were lost must not keep a VM forever); in every mode but
manual when a running VM's registration vanished and no job record names its runner (GitHub
removes an ephemeral runner after its job: the poll may find the job it ran, else the VM is
replaced); never in manual mode, nor twice in one pass, nor while GitHub is failing, nor while
the rate-limit budget is low (``BudgetLow``: polling pauses, minting goes on).

:func:`next_poll_due` says when a poll next falls due by time alone, so the pass that ends
before it asks to run again then (``conclude``'s next pass): a pool at ``intervalSeconds: 5``
polls every 5 s, not at the next resync after its interval passed.
"""

from __future__ import annotations

from impvm.api.models import VMPhase
from impvm.scaling.poolpass.acts import PollRequest
from impvm.scaling.poolpass.memory import PollState
from impvm.scaling.poolpass.sizing import PoolLimits
from impvm.scaling.poolpass.world import PoolWorld
from impvm.scaling.warmpool import WarmPoolPolicy

__all__ = [
    "budget_low",
    "github_usable",
    "next_poll_due",
    "poll_first",
    "poll_since",
    "poll_wanted",
    "vanished",
]


def github_usable(world: PoolWorld) -> bool:
    """GitHub answered this pass and may be called again now."""
    g = world.github
    polled_ok = world.polled is None or world.polled.failure is None
    return (
        g.connected
        and not g.skipped
        and g.failure is None
        and polled_ok
        and world.memory.backoff.ready(world.mono)
    )


def budget_low(world: PoolWorld) -> bool:
    """Less than ``poll_budget_floor`` of the installation's rate limit is left."""
    b = world.github.budget
    floor = world.settings.poll_budget_floor
    return bool(b is not None and b.limit and b.remaining < floor * b.limit)


def vanished(world: PoolWorld) -> frozenset[str]:
    """Running VMs whose recorded registration GitHub no longer lists, with no job recorded and
    no job record naming their runner: did they run a job, or lose their registration?"""
    runners = world.github.runners
    if runners is None:
        return frozenset()
    listed = {r.id for r in runners}
    return frozenset(
        vm.name
        for vm in world.vms
        if vm.phase == VMPhase.RUNNING
        and not vm.deleting
        and vm.runner_id is not None
        and vm.runner_id not in listed
        and not vm.has_job
        and world.job_on(vm.name) is None
    )


def poll_wanted(world: PoolWorld) -> str | None:
    """Why GitHub should be polled for jobs now, or None (see the module docstring; the budget
    is not considered here)."""
    scaling = world.pool.spec.scaling
    mode = scaling.mode if scaling else "manual"
    g = world.github
    if mode == "manual" or world.polled is not None or g.runners is None:
        return None
    if not github_usable(world):
        return None
    polling = scaling.polling if scaling else None
    periodic = mode in ("polling", "hybrid") and polling is not None and polling.enabled
    poll = world.memory.poll
    if poll.last_poll is None:
        return "first poll since the operator started"
    since = world.mono - poll.last_poll
    busy = frozenset(r.name for r in g.runners if r.busy)
    if periodic and polling is not None and since >= polling.interval_seconds:
        return f"{since:.0f}s since the last poll (interval {polling.interval_seconds}s)"
    if periodic and not busy <= poll.busy_at_poll:
        return "a runner became busy since the last poll"
    gone = vanished(world) - poll.vanished_at_poll
    if gone:
        names = ", ".join(sorted(gone)[:3])
        return f"the registration of runner(s) {names} vanished with no job record"
    safety = world.settings.webhook_safety_poll_seconds
    if mode == "webhook" and since >= safety:
        return f"{since:.0f}s since the last poll (webhook-mode safety poll every {safety:.0f}s)"
    if mode == "webhook" and not poll.swept and since >= world.settings.resync_seconds:
        return "the first poll has not read every repository yet (start-up sweep)"
    return None


def poll_since(world: PoolWorld) -> float | None:
    """From when a poll answers the one :func:`poll_wanted` asks for (monotonic s): one that
    started since this pass began for the first (a delivery that came before the pool's route
    was published was routed without it, so GitHub's own read must show the pool its queued
    jobs; pools whose first passes begin before a poll starts share it); the moment it fell
    due for an interval or safety poll (a poll another pool of the installation started since
    then serves it too); now when the queue changed now (a runner became busy, a registration
    vanished)."""
    poll = world.memory.poll
    last = poll.last_poll
    if last is None:
        return world.mono
    scaling = world.pool.spec.scaling
    polling = scaling.polling if scaling else None
    mode = scaling.mode if scaling else "manual"
    since = world.mono - last
    if vanished(world) - poll.vanished_at_poll:
        return world.mono
    if mode in ("polling", "hybrid") and polling is not None and polling.enabled:
        if since >= polling.interval_seconds:
            return last + polling.interval_seconds
        return world.mono
    if not poll.swept:
        return min(world.mono, last + world.settings.resync_seconds)
    return min(world.mono, last + world.settings.webhook_safety_poll_seconds)


def next_poll_due(world: PoolWorld, poll: PollState) -> float | None:
    """When (monotonic s) :func:`poll_wanted` next asks for a poll by time alone, for a pool
    whose pass concluded ``poll``: ``last_poll + intervalSeconds`` in polling and hybrid modes
    with polling enabled; in webhook mode the start-up sweep's next poll (``resync_seconds``)
    until every repository was read once, then the safety poll. None when no poll falls due
    by time: manual mode, polling disabled in hybrid mode, or never polled (the first poll is
    made by the next pass that can reach GitHub)."""
    scaling = world.pool.spec.scaling
    mode = scaling.mode if scaling else "manual"
    last = poll.last_poll
    if scaling is None or mode == "manual" or last is None:
        return None
    s = world.settings
    if mode in ("polling", "hybrid"):
        polling = scaling.polling
        return last + polling.interval_seconds if polling and polling.enabled else None
    if not poll.swept:
        return last + min(s.resync_seconds, s.webhook_safety_poll_seconds)
    return last + s.webhook_safety_poll_seconds


def poll_first(world: PoolWorld) -> PollRequest | None:
    """The pass's first phase: a :class:`PollRequest` when GitHub must be polled before the
    pass decides, else None. Nothing is polled while the template, class or signing key is
    missing, while the spec is invalid (the second phase says so), or while the budget is
    low."""
    if not world.found:
        return None
    try:
        PoolLimits.from_spec(world.pool.spec)
        WarmPoolPolicy.from_spec(world.pool.spec.scaling)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        return None
    why = poll_wanted(world)
    if why is None or budget_low(world):
        return None
    return PollRequest(why, poll_since(world), vanished(world))
