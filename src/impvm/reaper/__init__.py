"""impvm.reaper: the pure decision table for runner VMs that outlive their job (after ARC's
proposed runner reaper). No I/O; see :mod:`impvm.reaper.table`."""

from impvm.reaper.table import (
    DEFAULT_COMPLETED_GRACE_SECONDS,
    DEFAULT_MAX_JOB_SECONDS,
    Action,
    JobInfo,
    Lookup,
    ReapVM,
    Rule,
    RunInfo,
    Verdict,
    format_duration,
    judge,
    lookup_failed,
    needs_lookup,
    parse_repository,
    parse_run_id,
)

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
