"""One reaper pass, pure, in the pool pass's shape: the shell (:mod:`impvm.operator.reaper`)
observes a :class:`ReapWorld` (the pool's VMs, then GitHub's answers for the
:func:`reap_lookups`), :func:`reap_acts` judges every VM, the shared executor deletes the VMs
judged ``delete``, and :func:`conclude_reap` reports: the :class:`ReapReport`, the pool's
``Reaper`` condition (True: the last pass was complete; False: ``TokenRefused``,
``TokenUnavailable``, ``NotJudged``, ``ListFailed``, ``DeleteFailed``, ``CredentialsInvalid``)
and its Events (``RunnerReaped`` for each deletion; a Warning when the condition changed to a
failure).

A VM is only deleted on a positive answer from GitHub; no message carries a secret (GitHub
errors are redacted by the client, ours name keys and ids only).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from impvm.api.conditions import ConditionSet
from impvm.api.models import ReaperSpec
from impvm.api.vm import VM
from impvm.reaper.facts import JobInfo, RunInfo
from impvm.reaper.report import ReapOutcome, ReapReport
from impvm.reaper.table import Action, Lookup, ReapVerdict, judge, lookup_failed, needs_lookup

__all__ = [
    "CONDITION_TYPE",
    "Answer",
    "ReapActs",
    "ReapConclusion",
    "ReapEvent",
    "ReapWorld",
    "conclude_reap",
    "reap_acts",
    "reap_lookups",
]

#: Type of the pool condition reporting the last pass.
CONDITION_TYPE = "Reaper"
#: What GitHub said of one VM's run (and job), or why it could not be read (no secret in it).
Answer = tuple[RunInfo, JobInfo | None] | str

_DEREGISTERED = {
    None: "",
    "deleted": ", runner deregistered",
    "busy": ", runner still busy at GitHub (released when its job ends)",
    "not_found": ", runner already deregistered",
    "failed": ", runner deregistration failed",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapWorld:
    """What one reaper pass of pool ``namespace/pool`` read.

    - ``spec``: the pool's ``spec.reaper``; ``now``: the pass's clock reading;
    - ``vms``: the VMs the pool controls; ``answers``: GitHub's answer for each VM looked up,
      by name;
    - ``error`` / ``error_reason``: why the pass as a whole reads nothing (VMs not listable,
      credentials unreadable, no installation token); ``stored_status``: the pool's status as
      read (its conditions) and ``generation``.
    """

    namespace: str
    pool: str
    spec: ReaperSpec
    now: dt.datetime
    vms: tuple[VM, ...] = ()
    answers: Mapping[str, Answer] = field(default_factory=dict)
    error: str | None = None
    error_reason: str | None = None
    stored_status: Mapping[str, Any] = field(default_factory=dict)
    generation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapActs:
    """The verdicts of a pass (by VM, with what the VM records) and the VMs to delete."""

    outcomes: tuple[ReapOutcome, ...] = ()
    delete: tuple[ReapOutcome, ...] = ()


@dataclass(frozen=True, slots=True)
class ReapEvent:
    """A core/v1 Event on the pool: reason (CamelCase), message (no secret), type."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapConclusion:
    """The end of a reaper pass: the report, the ``Reaper`` condition to write (None: it did
    not change), and the Events."""

    report: ReapReport
    condition: dict[str, Any] | None
    events: tuple[ReapEvent, ...] = ()


def reap_lookups(vms: tuple[VM, ...]) -> tuple[tuple[VM, Lookup], ...]:
    """The VMs whose judgement needs GitHub, and what to read for each (rows 1-3 of the table
    decide the others without any call)."""
    out = []
    for vm in vms:
        first = needs_lookup(vm)
        if isinstance(first, Lookup):
            out.append((vm, first))
    return tuple(out)


def _outcome(vm: VM, verdict: ReapVerdict, lookup: Lookup | None) -> ReapOutcome:
    return ReapOutcome(
        vm=vm.name,
        verdict=verdict,
        run_id=lookup.run_id if lookup else None,
        repository=lookup.repository if lookup else None,
        runner_id=vm.runner_id,
    )


def reap_acts(world: ReapWorld) -> ReapActs:
    """Judge every VM (:func:`impvm.reaper.table.judge` over GitHub's answer; a VM whose run or
    job could not be read is not judged); those judged ``delete`` go, but in a dry run (or
    when the pass failed as a whole: nothing is deleted then)."""
    outcomes: list[ReapOutcome] = []
    for vm in world.vms:
        first = needs_lookup(vm)
        if isinstance(first, ReapVerdict):
            outcomes.append(_outcome(vm, first, None))
            continue
        answer = world.answers.get(vm.name, "not read")
        if isinstance(answer, str):
            verdict = lookup_failed(vm, first, answer)
        else:
            run, job = answer
            s = world.spec
            verdict = judge(
                vm,
                run,
                job,
                world.now,
                max_job_seconds=s.max_job_seconds,
                completed_grace_seconds=s.completed_grace_seconds,
            )
        outcomes.append(_outcome(vm, verdict, first))
    doomed = tuple(o for o in outcomes if o.verdict.action is Action.DELETE)
    hold = world.spec.dry_run or world.error is not None
    return ReapActs(outcomes=tuple(outcomes), delete=() if hold else doomed)


def conclude_reap(
    world: ReapWorld, acts: ReapActs, done: Mapping[str, tuple[str | None, bool]]
) -> ReapConclusion:
    """The report, condition and Events once the deletions ran (``done``: by VM,
    ``(deregistration, deleted)``)."""
    report = ReapReport(
        namespace=world.namespace,
        pool=world.pool,
        dry_run=world.spec.dry_run,
        error=world.error,
        error_reason=world.error_reason,
    )
    events: list[ReapEvent] = []
    for o in acts.outcomes:
        if o.verdict.action is Action.NOT_JUDGED:
            report.unjudged.append(o)
        elif o.verdict.action is not Action.DELETE:
            report.kept.append(o)
        elif world.spec.dry_run:
            report.would_delete.append(o)
        else:
            dereg, deleted = done.get(o.vm, (None, False))
            o = ReapOutcome(
                vm=o.vm,
                verdict=o.verdict,
                run_id=o.run_id,
                repository=o.repository,
                runner_id=o.runner_id,
                deregistration=dereg,
            )
            (report.deleted if deleted else report.failed).append(o)
            if deleted:
                events.append(ReapEvent("RunnerReaped", _reaped(o)))
    condition, changed = _condition(world, report)
    if changed and condition["status"] == "False":
        events.append(ReapEvent(f"Reaper{condition['reason']}", report.summary(), warning=True))
    return ReapConclusion(
        report=report, condition=condition if changed else None, events=tuple(events)
    )


def _reaped(o: ReapOutcome) -> str:
    runner = f"runner {o.runner_id}" if o.runner_id is not None else "no runner id"
    return (
        f"deleted VM {o.vm} ({runner}{_DEREGISTERED.get(o.deregistration, '')}): run "
        f"{o.run_id} in {o.repository}, rule {o.verdict.rule}: {o.verdict.reason}"
    )


def _condition(world: ReapWorld, report: ReapReport) -> tuple[dict[str, Any], bool]:
    """The ``Reaper`` condition of ``report`` and whether its status, reason or message
    differ from the one stored."""
    if report.error is not None:
        ok, reason = False, report.error_reason or "Failed"
    elif report.unjudged:
        ok, reason = False, "NotJudged"
    elif report.failed:
        ok, reason = False, "DeleteFailed"
    else:
        ok, reason = True, "PassComplete"
    conds = ConditionSet.from_status(world.stored_status, world.generation)
    before = next((c for c in conds.as_list() if c["type"] == CONDITION_TYPE), None)
    conds.set(CONDITION_TYPE, ok, reason, report.summary(), world.now)
    after = next(c for c in conds.as_list() if c["type"] == CONDITION_TYPE)
    changed = before is None or any(
        before.get(k) != after[k] for k in ("status", "reason", "message")
    )
    return after, changed
