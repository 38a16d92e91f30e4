"""impvm.reaper: the pure reaper of runner VMs that outlive their job (after ARC's proposed
runner reaper): the decision table (:mod:`impvm.reaper.table`), what GitHub said
(:mod:`impvm.reaper.facts`), one pass (:mod:`impvm.reaper.reap`) and its report
(:mod:`impvm.reaper.report`). No I/O."""

from impvm.reaper.facts import (
    DEFAULT_COMPLETED_GRACE_SECONDS,
    DEFAULT_MAX_JOB_SECONDS,
    JobInfo,
    RunInfo,
    format_duration,
    parse_repository,
    parse_run_id,
)
from impvm.reaper.reap import (
    CONDITION_TYPE,
    Answer,
    ReapActs,
    ReapConclusion,
    ReapEvent,
    ReapWorld,
    conclude_reap,
    reap_acts,
    reap_lookups,
)
from impvm.reaper.report import ReapOutcome, ReapReport
from impvm.reaper.table import (
    Action,
    JobRecord,
    Lookup,
    ReapVerdict,
    Rule,
    judge,
    lookup_failed,
    needs_lookup,
    recorded_job,
)

__all__ = [
    "CONDITION_TYPE",
    "DEFAULT_COMPLETED_GRACE_SECONDS",
    "DEFAULT_MAX_JOB_SECONDS",
    "Action",
    "Answer",
    "JobInfo",
    "JobRecord",
    "Lookup",
    "ReapActs",
    "ReapConclusion",
    "ReapEvent",
    "ReapOutcome",
    "ReapReport",
    "ReapVerdict",
    "ReapWorld",
    "Rule",
    "RunInfo",
    "conclude_reap",
    "format_duration",
    "judge",
    "lookup_failed",
    "needs_lookup",
    "parse_repository",
    "parse_run_id",
    "reap_acts",
    "reap_lookups",
    "recorded_job",
]
