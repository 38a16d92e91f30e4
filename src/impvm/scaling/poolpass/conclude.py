"""The last phase of a pool pass: ``conclude_pass(world, acts, done) -> PassConclusion``, once
the acts were carried out: the pool's status and conditions, the Events, the memory the next
pass starts from and when it runs. Pure: a ladder like :mod:`~impvm.scaling.poolpass.decide`'s.

1. template, class or signing key missing: ``TemplateMissing`` True, ``Ready`` False, again in
   30 s (``template_missing_requeue_seconds``);
2. an invalid spec: ``Ready`` False (``InvalidSpec``); a class the pool's namespace may not use
   (its ``spec.namespaces``): ``ClassNotAllowed`` True, ``Ready`` False, no VM is made, idle ones
   are scaled down, busy ones finish;
3. otherwise the conditions of GitHub's answers (:mod:`~impvm.scaling.poolpass.failures`), a low
   rate-limit budget (``RateLimited``/``BudgetLow``: polling pauses), start failures
   (``TemplateFailing``), placement (``Unschedulable``), the status (counts with the VMs
   created), ``Ready``, and the next pass: soon while VMs are being made or await their runner
   (``busy_resync_seconds``), else ``resync_seconds``, sooner for the next poll falling due
   (:func:`~impvm.scaling.poolpass.poll.next_poll_due`: a poll interval shorter than the
   resync is kept), a backoff's end, a VM becoming unschedulable or the next VM after start
   failures.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from impvm.api.conditions import ConditionSet
from impvm.api.models import ImpVMRunnerPoolStatus
from impvm.api.times import k8s_time
from impvm.scaling import timings
from impvm.scaling.poolpass.acts import (
    ActsDone,
    Deregistration,
    EventSpec,
    PassConclusion,
    PoolActs,
    Why,
)
from impvm.scaling.poolpass.failures import GitHubVerdict, github_verdict, wait
from impvm.scaling.poolpass.lost import acceleration, placement, unschedulable_due
from impvm.scaling.poolpass.memory import PollState, PoolMemory
from impvm.scaling.poolpass.poll import budget_low, next_poll_due, poll_wanted
from impvm.scaling.poolpass.sizing import Counts
from impvm.scaling.poolpass.starts import next_start, start_condition
from impvm.scaling.poolpass.status import needs_write, pool_status
from impvm.scaling.poolpass.world import PoolWorld
from impvm.scaling.runnerlist import fresh_wait

__all__ = ["CONDITION_TYPES", "conclude_pass"]

#: Condition types the pool pass owns (the reaper owns ``Reaper``).
CONDITION_TYPES = (
    "ClassNotAllowed",
    "CredentialsInvalid",
    "Emulated",
    "GitHubUnavailable",
    "RateLimited",
    "Ready",
    "TemplateFailing",
    "TemplateMissing",
    "Unschedulable",
)


#: how long after a poll falls due the pass that makes it runs (seconds)
POLL_DUE_SLACK_SECONDS = 0.01


def conclude_pass(world: PoolWorld, acts: PoolActs, done: ActsDone) -> PassConclusion:
    """The end of the pass once ``acts`` were carried out with ``done`` (see the module
    docstring for the ladder)."""
    conds = ConditionSet.from_status(world.pool.stored_status, world.pool.generation)
    events: list[EventSpec] = list(acts.events)
    if not world.found:
        return _missing(world, conds, events)
    found = f"template {world.template.name} and class {world.vm_class.name}"  # type: ignore[union-attr]
    conds.set("TemplateMissing", False, "Found", found, world.now)
    if world.class_denied:
        if conds.set(
            "ClassNotAllowed", True, "NamespaceNotSelected", world.class_denied, world.now
        ):
            events.append(EventSpec("ClassNotAllowed", world.class_denied, warning=True))
    else:
        cname = world.vm_class.name  # type: ignore[union-attr]
        conds.set("ClassNotAllowed", False, "Allowed", f"class {cname}", world.now)
    if acts.why is Why.INVALID_SPEC or acts.sizing is None:
        text = acts.events[0].message if acts.events else "invalid spec"
        conds.set("Ready", False, "InvalidSpec", text, world.now)
        status = ImpVMRunnerPoolStatus(observed_generation=world.pool.generation)
        return _end(world, status, conds, events, world.memory, world.settings.resync_seconds)
    return _acted(world, acts, done, conds, events)


def _missing(world: PoolWorld, conds: ConditionSet, events: list[EventSpec]) -> PassConclusion:
    """Rung 1: nothing could be made; say what is missing."""
    tname, ns = world.pool.spec.template_name, world.pool.namespace
    if world.template is None:
        reason = "NotFound"
        msg = f"ImpVMTemplate {tname!r} not found in namespace {ns}; retrying in 30s"
    elif world.verify_key_problem:  # fail closed: a VM without its key would boot unverified
        reason = "VerifyKeyMissing"
        msg = f"ImpVMTemplate {tname!r}: {world.verify_key_problem}; retrying in 30s"
    else:
        reason = "ClassNotFound"
        cname = world.template.spec.class_ref.name
        msg = f"ImpVMClass {cname!r} (from template {tname!r}) not found; retrying in 30s"
    if conds.set("TemplateMissing", True, reason, msg, world.now):
        events.append(EventSpec("TemplateMissing", msg, warning=True))
    conds.set("Ready", False, "TemplateMissing", msg, world.now)
    status = ImpVMRunnerPoolStatus(observed_generation=world.pool.generation)
    requeue = world.settings.template_missing_requeue_seconds
    return _end(world, status, conds, events, world.memory, requeue)


def _acted(
    world: PoolWorld, acts: PoolActs, done: ActsDone, conds: ConditionSet, events: list[EventSpec]
) -> PassConclusion:
    """Rung 3: the conditions, status, memory and next pass of a pass that decided acts."""
    assert acts.sizing is not None
    now = world.now
    events += _deletions(acts, done)
    gh = github_verdict(world, acts, done, conds, events)
    poll = _budget(world, conds)
    starts = acts.starts or world.memory.starts
    start_condition(world, starts, conds, events)
    c = acts.sizing.counts
    c = replace(c, starting=c.starting + done.created, total=c.total + done.created)
    window = timings.observe(world.memory.timings, world.vms, now)
    status = pool_status(world, acts, done, c, window)
    if acts.warm is not None:
        decision = acts.warm[0]
        was = world.pool.status.warm_pool.target if world.pool.status.warm_pool else None
        if was is not None and was != decision.target:
            text = f"warm pool target {was} -> {decision.target}: {decision.reason}"
            events.append(EventSpec("WarmPoolResized", text[:1000]))
    if done.created:
        text = f"created {done.created} VM(s): {acts.sizing.create_reason}"
        events.append(EventSpec("ScaledUp", text[:1000]))
    _ready(world, gh, acts, c, conds)
    placement(world, conds, events)
    acceleration(world, conds, events)
    memory = PoolMemory(
        backoff=gh.backoff,
        poll=poll,
        warm=acts.warm[1] if acts.warm is not None else world.memory.warm,
        timings=window,
        starts=starts,
        route=world.route or world.memory.route,
    )
    requeue = _requeue(world, acts, done, memory)
    return _end(world, status, conds, events, memory, requeue, c)


def _deletions(acts: PoolActs, done: ActsDone) -> list[EventSpec]:
    """``VMDeleted`` for each VM the acts deleted, ``ScaleDownSkipped`` for each kept because
    its runner took a job meanwhile (GitHub answered 422)."""
    why = {d.name: d.why for d in acts.deletions}
    out: list[EventSpec] = []
    for d in done.deleted:
        if d.gone and not d.missing:
            out.append(EventSpec("VMDeleted", f"{d.name}: {why.get(d.name, '')}"[:1000]))
        elif d.deregistration is Deregistration.BUSY and not d.gone:
            out.append(EventSpec("ScaleDownSkipped", f"runner {d.name} is busy; VM kept"))
    return out


def _budget(world: PoolWorld, conds: ConditionSet) -> PollState:
    """``RateLimited``/``BudgetLow`` while a wanted poll waits for budget; the poll state (a
    poll skipped for budget is tried again at the next interval)."""
    poll = world.memory.poll
    if poll_wanted(world) is None or not budget_low(world):
        return poll
    b = world.github.budget
    assert b is not None
    reset = dt.datetime.fromtimestamp(b.reset, dt.UTC)
    text = (
        f"{b.remaining}/{b.limit} requests left until {k8s_time(reset)}; polling paused, "
        "JIT minting continues"
    )
    conds.set("RateLimited", True, "BudgetLow", text, world.now)
    return replace(poll, last_poll=world.mono)


def _ready(
    world: PoolWorld, gh: GitHubVerdict, acts: PoolActs, c: Counts, conds: ConditionSet
) -> None:
    """``Ready``: False with why (a class the namespace may not use, GitHub, a mint), else True
    with the counts."""
    if world.class_denied:
        conds.set("Ready", False, "ClassNotAllowed", world.class_denied, world.now)
    elif gh.ready_failure is not None:
        conds.set("Ready", False, *gh.ready_failure, world.now)
    elif gh.last is not None:
        conds.set("Ready", False, gh.last.kind.value, gh.last.message, world.now)
    else:
        text = f"{c.idle} idle, {c.busy} busy, {c.starting} starting; desired {c.desired}"
        if acts.held_back:
            text += f"; {acts.held_back}"
        conds.set("Ready", True, "Reconciled", text, world.now)


def _requeue(world: PoolWorld, acts: PoolActs, done: ActsDone, memory: PoolMemory) -> float:
    """Seconds until the next pass (see the module docstring)."""
    s, sizing = world.settings, acts.sizing
    assert sizing is not None
    # starting VMs are watched closely only while their runners are due: one stuck longer is
    # left to the bootstrap timeout (the runner list is not re-read for it either)
    starting = sizing.counts.starting > 0 and fresh_wait(world.vms, world.now, s)
    busy = sizing.create > done.created or starting or bool(sizing.mint_secrets)
    requeue = s.busy_resync_seconds if busy else s.resync_seconds
    if (due := unschedulable_due(world)) is not None:  # the condition on time, not late
        requeue = min(requeue, due)
    poll_at = next_poll_due(world, memory.poll)
    if poll_at is not None and memory.backoff.ready(world.mono):
        # the pass that polls runs when the poll falls due (a hair after: a timer may fire a
        # little early), not at the first resync after it
        requeue = min(
            requeue, max(POLL_DUE_SLACK_SECONDS, poll_at - world.mono + POLL_DUE_SLACK_SECONDS)
        )
    if not memory.backoff.ready(world.mono):
        requeue = min(requeue, max(1.0, wait(memory.backoff, world.mono)))
    at = next_start(memory.starts, world)
    if at is not None and at > world.now:
        requeue = min(requeue, max(0.5, (at - world.now).total_seconds()))
    return requeue


def _end(
    world: PoolWorld,
    status: ImpVMRunnerPoolStatus,
    conds: ConditionSet,
    events: list[EventSpec],
    memory: PoolMemory,
    requeue: float,
    counts: Counts | None = None,
) -> PassConclusion:
    if world.route is not None:
        memory = replace(memory, route=world.route)
    return PassConclusion(
        status=status,
        conditions=tuple(conds.ours()),
        write=needs_write(world, status, conds),
        events=tuple(events),
        memory=memory,
        requeue=requeue,
        counts=counts,
    )
