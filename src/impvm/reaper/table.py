"""The reaper's decision table: should a runner VM that may have outlived its job be deleted?

Pure (no I/O, no clock). Two steps, so the caller knows which VMs need GitHub reads:

1. :func:`needs_lookup` ``(VM) -> Lookup | ReapVerdict`` — a VM that is being deleted, idle (no
   job recorded) or whose job record is malformed gets its :class:`ReapVerdict` at once and **no
   GitHub call is made for it**; otherwise the :class:`Lookup` says which run (and job) to read.
2. :func:`judge` ``(VM, RunInfo, JobInfo | None, now, ...) -> ReapVerdict`` over what GitHub
   said.

The VM is the one read model (:class:`impvm.api.vm.VM`); its job record is read as stored
(``status.job``), never trusted: a run id that is not a positive integer or a repository that
is not ``owner/name`` is a malformed record, judged by no one.

The table (after the ARC pull request "feat(arc): add an optional reaper for runner pods that
outlive their job"), first matching row wins:

====  ===========================================================  ==========  ============
row   condition                                                    action      rule
====  ===========================================================  ==========  ============
1     VM being deleted                                             keep        Deleting
2     no job recorded (idle)                                       keep        Idle
3     malformed job record (run id not a positive integer,         not_judged  Malformed
      repository not ``owner/name``, run id missing)
4     run completed (cancelled included) >= grace ago              delete      RunCompleted
5     run completed < grace ago                                    keep        InGrace
6     run not completed, this VM's job completed >= grace ago      delete      JobCompleted
7     run not completed, this VM's job completed < grace ago       keep        InGrace
8     job started > ``max_job_seconds`` ago and still running      delete      JobTooLong
9     otherwise                                                    keep        Running
====  ===========================================================  ==========  ============

A VM is only deleted on a positive answer from GitHub: when the run or job cannot be read the
caller reports :func:`lookup_failed` (not judged) and leaves the VM alone (ARC's reaper
proposal, failure behaviour). Durations are seconds; datetimes must be timezone-aware
(:mod:`impvm.reaper.facts` holds what GitHub said and the record's parsing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from impvm.api.times import parse_time
from impvm.api.vm import VM
from impvm.reaper.facts import (
    DEFAULT_COMPLETED_GRACE_SECONDS,
    DEFAULT_MAX_JOB_SECONDS,
    JobInfo,
    RunInfo,
    format_duration,
    parse_repository,
    parse_run_id,
)

__all__ = [
    "Action",
    "JobRecord",
    "Lookup",
    "ReapVerdict",
    "Rule",
    "judge",
    "lookup_failed",
    "needs_lookup",
    "recorded_job",
]

_COMPLETED = "completed"


class Action(StrEnum):
    """What to do with a VM."""

    DELETE = "delete"
    KEEP = "keep"
    NOT_JUDGED = "not_judged"


class Rule(StrEnum):
    """Which row of the table decided (CamelCase: an Event reason or metric label)."""

    DELETING = "Deleting"
    IDLE = "Idle"
    MALFORMED = "Malformed"
    LOOKUP_FAILED = "LookupFailed"
    RUN_COMPLETED = "RunCompleted"
    JOB_COMPLETED = "JobCompleted"
    IN_GRACE = "InGrace"
    JOB_TOO_LONG = "JobTooLong"
    RUNNING = "Running"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReapVerdict:
    """``action`` on a VM, the table ``rule`` that chose it, and ``reason``: a sentence naming
    the run, repository and durations, fit for a log line or an Event message."""

    action: Action
    rule: Rule
    reason: str

    @property
    def delete(self) -> bool:
        """Whether the VM is to be deleted."""
        return self.action is Action.DELETE


@dataclass(frozen=True, slots=True, kw_only=True)
class Lookup:
    """The GitHub reads one VM needs: ``GET /repos/{repository}/actions/runs/{run_id}`` and, when
    ``job_id`` is known, ``GET /repos/{repository}/actions/jobs/{job_id}``."""

    repository: str
    run_id: int
    job_id: int | None


# --------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRecord:
    """A VM's job record as stored (``status.job``), its fields raw: ``job_id``,
    ``workflow_run_id``, ``repository`` (validated by :func:`needs_lookup`, not here) and
    ``started_at`` (None when absent or not a time)."""

    job_id: int | None = None
    workflow_run_id: object = None
    repository: object = None
    started_at: datetime | None = None


def recorded_job(vm: VM) -> JobRecord:
    """The job record of ``vm`` as stored (what :func:`needs_lookup` judges)."""
    raw: Any = (vm.stored_status or {}).get("job")
    if not isinstance(raw, Mapping):
        j = vm.status.job
        if j is None:
            return JobRecord()
        return JobRecord(
            job_id=j.id,
            workflow_run_id=j.workflow_run_id,
            repository=j.repository,
            started_at=j.started_at,
        )
    try:
        started = parse_time(raw.get("startedAt"))
    except ValueError:
        started = None
    job_id = raw.get("id")
    return JobRecord(
        job_id=job_id if isinstance(job_id, int) and not isinstance(job_id, bool) else None,
        workflow_run_id=raw.get("workflowRunId"),
        repository=raw.get("repository"),
        started_at=started,
    )


def needs_lookup(vm: VM) -> Lookup | ReapVerdict:
    """Rows 1-3: a :class:`ReapVerdict` needing no GitHub call, or the :class:`Lookup` to make.

    Being deleted -> keep; no job recorded -> keep (idle); a job recorded but the run id not a
    positive integer or the repository not ``owner/name`` -> not judged. Source: ARC's reaper
    proposal ("never touches an idle runner or one it could not judge").
    """
    if vm.deleting:
        return ReapVerdict(
            action=Action.KEEP, rule=Rule.DELETING, reason=f"VM {vm.name} is already being deleted"
        )
    if not vm.has_job:
        return ReapVerdict(
            action=Action.KEEP, rule=Rule.IDLE, reason=f"VM {vm.name} has no job recorded (idle)"
        )
    job = recorded_job(vm)
    run_id = parse_run_id(job.workflow_run_id)
    repository = parse_repository(job.repository)
    problems = []
    if run_id is None:
        problems.append(f"workflow run id {job.workflow_run_id!r} is not a positive integer")
    if repository is None:
        problems.append(f"repository {job.repository!r} is not owner/name")
    if run_id is None or repository is None:
        return ReapVerdict(
            action=Action.NOT_JUDGED,
            rule=Rule.MALFORMED,
            reason=f"VM {vm.name} not judged: malformed job record ({'; '.join(problems)})",
        )
    return Lookup(repository=repository, run_id=run_id, job_id=job.job_id)


def lookup_failed(vm: VM, lookup: Lookup, error: str) -> ReapVerdict:
    """Verdict on a VM whose run or job could not be read: not judged, never deleted (ARC's
    reaper proposal: "if one runner's run or jobs cannot be read, that runner is left alone").
    ``error`` must not hold a secret (it is put in the reason)."""
    return ReapVerdict(
        action=Action.NOT_JUDGED,
        rule=Rule.LOOKUP_FAILED,
        reason=f"VM {vm.name} not judged: reading run {lookup.run_id} in {lookup.repository} "
        f"failed: {error}",
    )


def judge(
    vm: VM,
    run: RunInfo,
    job: JobInfo | None,
    now: datetime,
    max_job_seconds: int = DEFAULT_MAX_JOB_SECONDS,
    completed_grace_seconds: int = DEFAULT_COMPLETED_GRACE_SECONDS,
) -> ReapVerdict:
    """The whole table (module docstring) for one VM and what GitHub said about it.

    ``run``: the VM's workflow run; ``job``: the VM's own job (None when no job id is recorded
    or GitHub did not return it); ``now``: the pass's clock reading; ``max_job_seconds`` and
    ``completed_grace_seconds`` in seconds (``spec.reaper``). Completed counts once completed for
    *at least* the grace (``>=``); a job is too long once running *more than* the bound (``>``).
    Rows 1-3 are re-checked here, so ``judge`` alone is safe to call. Source: ARC's reaper proposal.
    """
    first = needs_lookup(vm)
    if isinstance(first, ReapVerdict):
        return first
    where = f"run {first.run_id} in {first.repository}"
    grace = format_duration(completed_grace_seconds)

    if run.status == _COMPLETED:
        age = (now - run.updated_at).total_seconds()
        outcome = (
            f"{where} completed ({run.conclusion or 'no conclusion'}) {format_duration(age)} ago"
        )
        if age >= completed_grace_seconds:
            return ReapVerdict(
                action=Action.DELETE,
                rule=Rule.RUN_COMPLETED,
                reason=f"{outcome}, past the {grace} grace; deleting VM {vm.name}",
            )
        return ReapVerdict(
            action=Action.KEEP,
            rule=Rule.IN_GRACE,
            reason=f"{outcome}, inside the {grace} grace; keeping VM {vm.name}",
        )

    job_name = f"job {first.job_id}" if first.job_id is not None else "the job"
    if job is not None and job.status == _COMPLETED:
        if job.completed_at is None:
            return ReapVerdict(
                action=Action.KEEP,
                rule=Rule.IN_GRACE,
                reason=f"{job_name} of {where} is completed but GitHub gives no completion "
                f"time; keeping VM {vm.name}",
            )
        age = (now - job.completed_at).total_seconds()
        outcome = (
            f"{job_name} of {where} ({run.status}) completed "
            f"({job.conclusion or 'no conclusion'}) {format_duration(age)} ago"
        )
        if age >= completed_grace_seconds:
            return ReapVerdict(
                action=Action.DELETE,
                rule=Rule.JOB_COMPLETED,
                reason=f"{outcome}, past the {grace} grace; deleting VM {vm.name}",
            )
        return ReapVerdict(
            action=Action.KEEP,
            rule=Rule.IN_GRACE,
            reason=f"{outcome}, inside the {grace} grace; keeping VM {vm.name}",
        )

    started = job.started_at if job is not None and job.started_at else recorded_job(vm).started_at
    bound = format_duration(max_job_seconds)
    if started is None:
        return ReapVerdict(
            action=Action.KEEP,
            rule=Rule.RUNNING,
            reason=f"{job_name} of {where} ({run.status}) has no start time; keeping VM {vm.name}",
        )
    running = (now - started).total_seconds()
    outcome = f"{job_name} of {where} ({run.status}) started {format_duration(running)} ago"
    if running > max_job_seconds:
        return ReapVerdict(
            action=Action.DELETE,
            rule=Rule.JOB_TOO_LONG,
            reason=f"{outcome}, past the {bound} bound; deleting VM {vm.name}",
        )
    return ReapVerdict(
        action=Action.KEEP,
        rule=Rule.RUNNING,
        reason=f"{outcome}, within the {bound} bound; keeping VM {vm.name}",
    )
