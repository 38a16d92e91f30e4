"""The reaper's decision table: should a runner VM that may have outlived its job be deleted?

Pure (no I/O, no clock). Two steps, so the caller knows which VMs need GitHub reads:

1. :func:`needs_lookup` ``(ReapVM) -> Lookup | Verdict`` — a VM that is being deleted, idle (no
   job recorded) or whose job record is malformed gets its :class:`Verdict` at once and **no
   GitHub call is made for it**; otherwise the :class:`Lookup` says which run (and job) to read.
2. :func:`judge` ``(ReapVM, RunInfo, JobInfo | None, now, ...) -> Verdict`` over what GitHub said.

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
proposal, failure behaviour). Durations are seconds; datetimes must be timezone-aware.

GitHub's workflow run ``status`` is ``completed`` for every finished run, whatever its
``conclusion`` (success, failure, **cancelled**, timed_out, skipped, ...); a run has no
``completed_at``, so the time it completed is its ``updated_at`` (REST "Get a workflow run").
A job has ``completed_at`` (REST "Get a job for a workflow run").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from impvm.api.models import REPO_PATTERN, ImpVMStatus

__all__ = [
    "DEFAULT_COMPLETED_GRACE_SECONDS",
    "DEFAULT_MAX_JOB_SECONDS",
    "Action",
    "JobInfo",
    "Lookup",
    "ReapVM",
    "Rule",
    "RunInfo",
    "Verdict",
    "format_duration",
    "judge",
    "lookup_failed",
    "needs_lookup",
    "parse_repository",
    "parse_run_id",
]

#: Default of ``spec.reaper.completedGraceSeconds``.
DEFAULT_COMPLETED_GRACE_SECONDS = 300
#: Default of ``spec.reaper.maxJobSeconds`` (``ReaperSpec``: 6 hours, GitHub's job limit on
#: hosted runners).
DEFAULT_MAX_JOB_SECONDS = 21600

_REPO_RE = re.compile(REPO_PATTERN)
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
class Verdict:
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
class ReapVM:
    """One VM as its ImpVM reports it; job fields are raw, as found in ``status.job``.

    - ``name``: the ImpVM's name; ``deleting``: ``metadata.deletionTimestamp`` is set.
    - ``job_id``: ``status.job.id`` (int or None).
    - ``workflow_run_id``: ``status.job.workflowRunId``, raw: int, str or None (validated by
      :func:`needs_lookup`, not here).
    - ``repository``: ``status.job.repository``, raw ``owner/name`` or None.
    - ``job_started_at``: ``status.job.startedAt``, used when GitHub's job is not available.
    """

    name: str
    deleting: bool = False
    job_id: int | None = None
    workflow_run_id: object = None
    repository: str | None = None
    job_started_at: datetime | None = None

    @classmethod
    def from_status(cls, *, name: str, deleting: bool, status: ImpVMStatus | None) -> ReapVM:
        """Build from an ImpVM's name, deletion state and parsed ``status``."""
        job = status.job if status is not None else None
        if job is None:
            return cls(name=name, deleting=deleting)
        return cls(
            name=name,
            deleting=deleting,
            job_id=job.id,
            workflow_run_id=job.workflow_run_id,
            repository=job.repository,
            job_started_at=job.started_at,
        )

    @property
    def has_job(self) -> bool:
        """Whether any job field is recorded (a VM without one is idle)."""
        return (
            self.job_id is not None
            or self.workflow_run_id is not None
            or self.repository is not None
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Lookup:
    """The GitHub reads one VM needs: ``GET /repos/{repository}/actions/runs/{run_id}`` and, when
    ``job_id`` is known, ``GET /repos/{repository}/actions/jobs/{job_id}``."""

    repository: str
    run_id: int
    job_id: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """A workflow run as GitHub reports it: ``status`` (queued, in_progress, completed, ...),
    ``conclusion`` (None until completed; cancelled is a conclusion of a completed run) and
    ``updated_at`` (when a completed run completed)."""

    status: str
    conclusion: str | None
    updated_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        """Parse GitHub's workflow-run object (fields ``status``, ``conclusion``,
        ``updated_at``). Raises KeyError/ValueError on a missing or unparsable field."""
        return cls(
            status=str(data["status"]),
            conclusion=_opt_str(data.get("conclusion")),
            updated_at=_parse_time(data["updated_at"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    """A workflow job as GitHub reports it: ``status``, ``conclusion``, ``started_at`` and
    ``completed_at`` (None until completed)."""

    status: str
    conclusion: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobInfo:
        """Parse GitHub's workflow-job object. Raises KeyError/ValueError on a missing
        ``status`` or an unparsable time."""
        started = data.get("started_at")
        completed = data.get("completed_at")
        return cls(
            status=str(data["status"]),
            conclusion=_opt_str(data.get("conclusion")),
            started_at=_parse_time(started) if started else None,
            completed_at=_parse_time(completed) if completed else None,
        )


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _parse_time(value: object) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"expected an ISO 8601 time, got {value!r}")
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.utcoffset() is None:
        raise ValueError(f"time without a timezone: {value!r}")
    return parsed


# --------------------------------------------------------------------------------------------
# Validation of the job record


def parse_run_id(raw: object) -> int | None:
    """The workflow run id as a positive int, or None when ``raw`` is not one.

    Accepts an int (not a bool) or a string of ASCII digits; rejects 0, negatives, floats,
    whitespace and anything else."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw > 0 else None
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        value = int(raw)
        return value if value > 0 else None
    return None


def parse_repository(raw: object) -> str | None:
    """``raw`` if it is a valid GitHub ``owner/name``, else None.

    Owner: 1-39 ASCII letters, digits or hyphens, not starting with a hyphen; name: 1-100 of
    ``[A-Za-z0-9._-]``, and not ``.`` or ``..`` (GitHub's naming rules; the pattern is
    :data:`impvm.api.models.REPO_PATTERN`)."""
    if not isinstance(raw, str) or not _REPO_RE.fullmatch(raw):
        return None
    if raw.split("/", 1)[1] in {".", ".."}:
        return None
    return raw


# --------------------------------------------------------------------------------------------
# The table


def format_duration(seconds: float) -> str:
    """A short human duration: ``45s``, ``5m``, ``1h30m``, ``1d``, ``10d2h``: the largest
    non-zero unit and the next one (dropped when zero), truncated; negative values read ``0s``."""
    total = max(0, int(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for i, (unit, size) in enumerate(units):
        if total >= size:
            text = f"{total // size}{unit}"
            if i + 1 < len(units):
                sub_unit, sub_size = units[i + 1]
                sub = (total % size) // sub_size
                if sub:
                    text += f"{sub}{sub_unit}"
            return text
    return "0s"


def needs_lookup(vm: ReapVM) -> Lookup | Verdict:
    """Rows 1-3: a :class:`Verdict` needing no GitHub call, or the :class:`Lookup` to make.

    Being deleted -> keep; no job recorded -> keep (idle); a job recorded but the run id not a
    positive integer or the repository not ``owner/name`` -> not judged. Source: ARC's reaper
    proposal ("never touches an idle runner or one it could not judge").
    """
    if vm.deleting:
        return Verdict(
            action=Action.KEEP, rule=Rule.DELETING, reason=f"VM {vm.name} is already being deleted"
        )
    if not vm.has_job:
        return Verdict(
            action=Action.KEEP, rule=Rule.IDLE, reason=f"VM {vm.name} has no job recorded (idle)"
        )
    run_id = parse_run_id(vm.workflow_run_id)
    repository = parse_repository(vm.repository)
    problems = []
    if run_id is None:
        problems.append(f"workflow run id {vm.workflow_run_id!r} is not a positive integer")
    if repository is None:
        problems.append(f"repository {vm.repository!r} is not owner/name")
    if run_id is None or repository is None:
        return Verdict(
            action=Action.NOT_JUDGED,
            rule=Rule.MALFORMED,
            reason=f"VM {vm.name} not judged: malformed job record ({'; '.join(problems)})",
        )
    return Lookup(repository=repository, run_id=run_id, job_id=vm.job_id)


def lookup_failed(vm: ReapVM, lookup: Lookup, error: str) -> Verdict:
    """Verdict for a VM whose run or job could not be read: not judged, never deleted (ARC's
    reaper proposal: "if one runner's run or jobs cannot be read, that runner is left alone").
    ``error`` must not hold a secret (it is put in the reason)."""
    return Verdict(
        action=Action.NOT_JUDGED,
        rule=Rule.LOOKUP_FAILED,
        reason=f"VM {vm.name} not judged: reading run {lookup.run_id} in {lookup.repository} "
        f"failed: {error}",
    )


def judge(
    vm: ReapVM,
    run: RunInfo,
    job: JobInfo | None,
    now: datetime,
    max_job_seconds: int = DEFAULT_MAX_JOB_SECONDS,
    completed_grace_seconds: int = DEFAULT_COMPLETED_GRACE_SECONDS,
) -> Verdict:
    """The whole table (module docstring) for one VM and what GitHub said about it.

    ``run``: the VM's workflow run; ``job``: the VM's own job (None when no job id is recorded
    or GitHub did not return it); ``now``: the pass's clock reading; ``max_job_seconds`` and
    ``completed_grace_seconds`` in seconds (``spec.reaper``). Completed counts once completed for
    *at least* the grace (``>=``); a job is too long once running *more than* the bound (``>``).
    Rows 1-3 are re-checked here, so ``judge`` alone is safe to call. Source: ARC's reaper proposal.
    """
    first = needs_lookup(vm)
    if isinstance(first, Verdict):
        return first
    where = f"run {first.run_id} in {first.repository}"
    grace = format_duration(completed_grace_seconds)

    if run.status == _COMPLETED:
        age = (now - run.updated_at).total_seconds()
        outcome = (
            f"{where} completed ({run.conclusion or 'no conclusion'}) {format_duration(age)} ago"
        )
        if age >= completed_grace_seconds:
            return Verdict(
                action=Action.DELETE,
                rule=Rule.RUN_COMPLETED,
                reason=f"{outcome}, past the {grace} grace; deleting VM {vm.name}",
            )
        return Verdict(
            action=Action.KEEP,
            rule=Rule.IN_GRACE,
            reason=f"{outcome}, inside the {grace} grace; keeping VM {vm.name}",
        )

    job_name = f"job {first.job_id}" if first.job_id is not None else "the job"
    if job is not None and job.status == _COMPLETED:
        if job.completed_at is None:
            return Verdict(
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
            return Verdict(
                action=Action.DELETE,
                rule=Rule.JOB_COMPLETED,
                reason=f"{outcome}, past the {grace} grace; deleting VM {vm.name}",
            )
        return Verdict(
            action=Action.KEEP,
            rule=Rule.IN_GRACE,
            reason=f"{outcome}, inside the {grace} grace; keeping VM {vm.name}",
        )

    started = job.started_at if job is not None and job.started_at else vm.job_started_at
    bound = format_duration(max_job_seconds)
    if started is None:
        return Verdict(
            action=Action.KEEP,
            rule=Rule.RUNNING,
            reason=f"{job_name} of {where} ({run.status}) has no start time; keeping VM {vm.name}",
        )
    running = (now - started).total_seconds()
    outcome = f"{job_name} of {where} ({run.status}) started {format_duration(running)} ago"
    if running > max_job_seconds:
        return Verdict(
            action=Action.DELETE,
            rule=Rule.JOB_TOO_LONG,
            reason=f"{outcome}, past the {bound} bound; deleting VM {vm.name}",
        )
    return Verdict(
        action=Action.KEEP,
        rule=Rule.RUNNING,
        reason=f"{outcome}, within the {bound} bound; keeping VM {vm.name}",
    )
