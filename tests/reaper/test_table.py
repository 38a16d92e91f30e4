"""Unit tests of the reaper's decision table, row by row, boundaries, the
seed-004 scenario, and properties."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impvm.api.models import ImpVMSpec
from impvm.api.vm import VM
from impvm.reaper import (
    DEFAULT_COMPLETED_GRACE_SECONDS,
    Action,
    JobInfo,
    JobRecord,
    Lookup,
    ReapVerdict,
    Rule,
    RunInfo,
    format_duration,
    judge,
    lookup_failed,
    needs_lookup,
    parse_repository,
    parse_run_id,
    recorded_job,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
HOUR = 3600
GRACE = 300


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


SPEC = ImpVMSpec.model_validate({"classRef": {"name": "c"}, "image": "i@sha256:" + "1" * 64})


def reap_vm(
    *,
    name: str = "vm",
    deleting: bool = False,
    job_id: object = None,
    workflow_run_id: object = None,
    repository: object = None,
    job_started_at: datetime | None = None,
) -> VM:
    """A VM whose stored job record (``status.job``) holds these raw values (the table never
    trusts the record: a value the API server would refuse must still not be judged)."""
    job = {
        "id": job_id,
        "workflowRunId": workflow_run_id,
        "repository": repository,
        "startedAt": job_started_at.isoformat() if job_started_at else None,
    }
    record = {k: v for k, v in job.items() if v is not None}
    stored = {"job": record} if record else {}
    return VM(namespace="ns", name=name, spec=SPEC, stored_status=stored, deleting=deleting)


def busy_vm(name: str = "vm", **kw: object) -> VM:
    fields: dict[str, object] = {
        "job_id": 7,
        "workflow_run_id": 42,
        "repository": "o/r",
        "job_started_at": ago(60),
    }
    fields.update(kw)
    return reap_vm(name=name, **fields)  # type: ignore[arg-type]


def running_run() -> RunInfo:
    return RunInfo(status="in_progress", conclusion=None, updated_at=ago(5))


def running_job(started: float = 60) -> JobInfo:
    return JobInfo(status="in_progress", started_at=ago(started))


def verdict(
    vm: VM,
    run: RunInfo,
    job: JobInfo | None = None,
    max_job: int = HOUR,
    grace: int = GRACE,
) -> ReapVerdict:
    return judge(vm, run, job, NOW, max_job_seconds=max_job, completed_grace_seconds=grace)


# --------------------------------------------------------------------------------------------
# Rows 1-3: decided without any GitHub call


def test_row1_deleting_is_kept_without_lookup() -> None:
    v = needs_lookup(busy_vm(deleting=True))
    assert isinstance(v, ReapVerdict)
    assert (v.action, v.rule) == (Action.KEEP, Rule.DELETING)
    assert "being deleted" in v.reason


def test_row2_idle_is_kept_without_lookup() -> None:
    v = needs_lookup(reap_vm(name="idle"))
    assert isinstance(v, ReapVerdict)
    assert (v.action, v.rule) == (Action.KEEP, Rule.IDLE)
    assert "idle" in v.reason and "idle" in v.reason.split()[1]


@pytest.mark.parametrize(
    ("run_id", "repository", "mentions"),
    [
        ("abc", "o/r", "'abc'"),
        ("", "o/r", "''"),
        ("12a", "o/r", "'12a'"),
        (" 12", "o/r", "' 12'"),
        ("-3", "o/r", "'-3'"),
        (0, "o/r", "0"),
        (-3, "o/r", "-3"),
        (4.0, "o/r", "4.0"),
        (True, "o/r", "True"),
        (None, "o/r", "None"),  # job recorded but no run id
        (42, None, "repository None"),
        (42, "o", "'o'"),
        (42, "o/r/x", "'o/r/x'"),
        (42, "-o/r", "'-o/r'"),
        (42, "o_o/r", "'o_o/r'"),
        (42, "o/", "'o/'"),
        (42, "/r", "'/r'"),
        (42, "o/..", "'o/..'"),
        (42, "o/r r", "'o/r r'"),
        (42, "a" * 40 + "/r", "is not owner/name"),
        (42, "o/" + "r" * 101, "is not owner/name"),
        ("x", "bad", "'x'"),
    ],
)
def test_row3_malformed_record_is_not_judged(
    run_id: object, repository: str | None, mentions: str
) -> None:
    vm = busy_vm(workflow_run_id=run_id, repository=repository)
    v = needs_lookup(vm)
    assert isinstance(v, ReapVerdict)
    assert (v.action, v.rule) == (Action.NOT_JUDGED, Rule.MALFORMED)
    assert mentions in v.reason
    # judge() re-checks and never deletes, whatever GitHub is claimed to have said.
    done = RunInfo(status="completed", conclusion="cancelled", updated_at=ago(10 * 86400))
    assert verdict(vm, done) == v


def test_job_id_alone_counts_as_a_recorded_job() -> None:
    v = needs_lookup(reap_vm(name="vm", job_id=3))
    assert isinstance(v, ReapVerdict) and v.rule is Rule.MALFORMED


def test_lookup_for_a_valid_record() -> None:
    assert needs_lookup(busy_vm(workflow_run_id="42")) == Lookup(
        repository="o/r", run_id=42, job_id=7
    )
    assert needs_lookup(busy_vm(job_id=None, repository="Octo-Org/my.repo_1-x")) == Lookup(
        repository="Octo-Org/my.repo_1-x", run_id=42, job_id=None
    )


def test_lookup_failed_is_not_judged_and_names_the_run() -> None:
    vm = busy_vm()
    lookup = needs_lookup(vm)
    assert isinstance(lookup, Lookup)
    v = lookup_failed(vm, lookup, "HTTP 404")
    assert (v.action, v.rule) == (Action.NOT_JUDGED, Rule.LOOKUP_FAILED)
    assert "run 42 in o/r" in v.reason and "HTTP 404" in v.reason


# --------------------------------------------------------------------------------------------
# Rows 4-5: run completed


@pytest.mark.parametrize("conclusion", ["cancelled", "success", "failure", "timed_out", None])
def test_row4_completed_run_past_grace_is_deleted(conclusion: str | None) -> None:
    run = RunInfo(status="completed", conclusion=conclusion, updated_at=ago(86400))
    v = verdict(busy_vm(), run, running_job())
    assert (v.action, v.rule) == (Action.DELETE, Rule.RUN_COMPLETED)
    assert v.delete
    assert f"run 42 in o/r completed ({conclusion or 'no conclusion'}) 1d ago" in v.reason


def test_row4_boundary_exactly_at_grace_deletes() -> None:
    run = RunInfo(status="completed", conclusion="success", updated_at=ago(GRACE))
    assert verdict(busy_vm(), run).action is Action.DELETE


def test_row5_completed_run_inside_grace_is_kept() -> None:
    run = RunInfo(status="completed", conclusion="success", updated_at=ago(GRACE - 1))
    v = verdict(busy_vm(), run)
    assert (v.action, v.rule) == (Action.KEEP, Rule.IN_GRACE)
    assert "4m59s ago" in v.reason and "5m grace" in v.reason


def test_completed_run_beats_the_job_bound() -> None:
    # Completed 10 s ago, job started 10 days ago: the grace lets the runner exit normally.
    run = RunInfo(status="completed", conclusion="success", updated_at=ago(10))
    v = verdict(busy_vm(job_started_at=ago(10 * 86400)), run, running_job(10 * 86400))
    assert v.action is Action.KEEP


def test_completed_run_in_the_future_reads_as_just_completed() -> None:
    run = RunInfo(status="completed", conclusion="success", updated_at=NOW + timedelta(seconds=30))
    v = verdict(busy_vm(), run)
    assert v.action is Action.KEEP and "0s ago" in v.reason


# --------------------------------------------------------------------------------------------
# Rows 6-7: run still going, this VM's job completed


def test_row6_completed_job_past_grace_is_deleted() -> None:
    job = JobInfo(
        status="completed", conclusion="success", started_at=ago(900), completed_at=ago(600)
    )
    v = verdict(busy_vm(), running_run(), job)
    assert (v.action, v.rule) == (Action.DELETE, Rule.JOB_COMPLETED)
    assert "job 7 of run 42 in o/r (in_progress) completed (success) 10m ago" in v.reason


def test_row6_boundary_exactly_at_grace_deletes() -> None:
    job = JobInfo(status="completed", conclusion="failure", completed_at=ago(GRACE))
    assert verdict(busy_vm(), running_run(), job).rule is Rule.JOB_COMPLETED


def test_row7_completed_job_inside_grace_is_kept() -> None:
    job = JobInfo(status="completed", conclusion="success", completed_at=ago(10))
    v = verdict(busy_vm(), running_run(), job)
    assert (v.action, v.rule) == (Action.KEEP, Rule.IN_GRACE)
    assert "10s ago" in v.reason


def test_completed_job_without_completion_time_is_kept() -> None:
    job = JobInfo(status="completed", conclusion="success", completed_at=None)
    v = verdict(busy_vm(), running_run(), job)
    assert v.action is Action.KEEP and "no completion time" in v.reason


def test_zero_grace_deletes_immediately() -> None:
    job = JobInfo(status="completed", conclusion="success", completed_at=NOW)
    assert verdict(busy_vm(), running_run(), job, grace=0).action is Action.DELETE


# --------------------------------------------------------------------------------------------
# Rows 8-9: job still running


def test_row8_job_past_the_bound_is_deleted() -> None:
    v = verdict(busy_vm(), running_run(), running_job(HOUR + 1))
    assert (v.action, v.rule) == (Action.DELETE, Rule.JOB_TOO_LONG)
    v = verdict(busy_vm(), running_run(), running_job(HOUR + 90))
    assert (v.action, v.rule) == (Action.DELETE, Rule.JOB_TOO_LONG)
    assert "job 7 of run 42 in o/r (in_progress) started 1h1m ago" in v.reason
    assert "1h bound" in v.reason


def test_row8_boundary_exactly_at_the_bound_is_kept() -> None:
    v = verdict(busy_vm(), running_run(), running_job(HOUR))
    assert (v.action, v.rule) == (Action.KEEP, Rule.RUNNING)


def test_row8_uses_the_vm_record_when_github_gives_no_job() -> None:
    vm = busy_vm(job_id=None, job_started_at=ago(HOUR + 1))
    v = verdict(vm, running_run(), None)
    assert v.rule is Rule.JOB_TOO_LONG
    assert "the job of run 42" in v.reason
    # GitHub's start time wins over the VM's record when both exist.
    v = verdict(busy_vm(job_started_at=ago(HOUR + 1)), running_run(), running_job(60))
    assert v.action is Action.KEEP


def test_row8_queued_run_with_long_job_is_deleted() -> None:
    run = RunInfo(status="queued", conclusion=None, updated_at=ago(5))
    assert verdict(busy_vm(), run, running_job(2 * HOUR)).delete


def test_row9_running_job_within_bound_is_kept() -> None:
    v = verdict(busy_vm(), running_run(), running_job(60))
    assert (v.action, v.rule) == (Action.KEEP, Rule.RUNNING)
    assert "started 1m ago, within the 1h bound" in v.reason


def test_row9_no_start_time_anywhere_is_kept() -> None:
    v = verdict(busy_vm(job_started_at=None), running_run(), JobInfo(status="queued"))
    assert v.action is Action.KEEP and "no start time" in v.reason


# --------------------------------------------------------------------------------------------
# The seed-004 scenario


def test_seed_004_scenario() -> None:
    """Four VMs: idle, hung (job started 10 days ago, bound 1 hour), cancelled run (completed
    1 day ago), busy (job started 60 s ago): the hung and cancelled ones go, idle and busy stay,
    the idle one needs no lookup."""
    vms = {
        "idle": reap_vm(name="idle"),
        "hung": busy_vm("hung", job_id=1, workflow_run_id=101, job_started_at=ago(10 * 86400)),
        "cancelled": busy_vm("cancelled", job_id=2, workflow_run_id=102),
        "busy": busy_vm("busy", job_id=3, workflow_run_id=103),
    }
    github = {
        101: (running_run(), running_job(10 * 86400)),
        102: (
            RunInfo(status="completed", conclusion="cancelled", updated_at=ago(86400)),
            JobInfo(status="completed", conclusion="cancelled", completed_at=ago(86400)),
        ),
        103: (running_run(), running_job(60)),
    }
    calls: list[int] = []
    verdicts: dict[str, ReapVerdict] = {}
    for name, vm in vms.items():
        first = needs_lookup(vm)
        if isinstance(first, ReapVerdict):
            verdicts[name] = first
            continue
        calls.append(first.run_id)
        run, job = github[first.run_id]
        verdicts[name] = judge(vm, run, job, NOW, max_job_seconds=HOUR)
    assert sorted(calls) == [101, 102, 103]  # no call for the idle VM
    assert {n: v.action for n, v in verdicts.items()} == {
        "idle": Action.KEEP,
        "hung": Action.DELETE,
        "cancelled": Action.DELETE,
        "busy": Action.KEEP,
    }
    assert verdicts["hung"].rule is Rule.JOB_TOO_LONG
    assert "started 10d ago" in verdicts["hung"].reason
    assert verdicts["cancelled"].rule is Rule.RUN_COMPLETED
    assert "run 102 in o/r completed (cancelled) 1d ago" in verdicts["cancelled"].reason
    # A job completed 10 s ago (inside the default grace) is kept.
    done = JobInfo(status="completed", conclusion="success", completed_at=ago(10))
    assert judge(vms["busy"], running_run(), done, NOW).action is Action.KEEP
    assert DEFAULT_COMPLETED_GRACE_SECONDS == 300


# --------------------------------------------------------------------------------------------
# Helpers and parsing


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (10.9, "10s"),
        (60, "1m"),
        (299, "4m59s"),
        (3600, "1h"),
        (5400, "1h30m"),
        (86400, "1d"),
        (10 * 86400 + 2 * 3600 + 5, "10d2h"),
        (3601, "1h"),
        (86400 + 59, "1d"),
        (61, "1m1s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_parse_run_id_and_repository() -> None:
    assert parse_run_id(42) == 42
    assert parse_run_id("42") == 42
    for bad in (0, -1, "0", "4 2", "4.2", 4.2, False, None, [42], "\u0664\u0662"):
        assert parse_run_id(bad) is None
    assert parse_repository("a/b") == "a/b"
    assert parse_repository("a" * 39 + "/" + "b" * 100) is not None
    for bad in (None, 3, "", "a", "a/b/c", "a b/c", "a/.", ".a/b", "a./b"):
        assert parse_repository(bad) is None
    assert parse_repository("a/.github") == "a/.github"


def test_the_job_record_is_read_from_the_vm_as_stored() -> None:
    body = {
        "metadata": {"name": "v", "namespace": "ns"},
        "spec": SPEC.wire(),
        "status": {
            "phase": "Running",
            "job": {"id": 5, "workflowRunId": 9, "repository": "o/r", "startedAt": "x"},
        },
    }
    vm = VM.from_body(body)  # a start that is not a time: the status is not readable
    assert vm.unreadable and vm.has_job
    assert recorded_job(vm) == JobRecord(job_id=5, workflow_run_id=9, repository="o/r")
    body["status"]["job"]["startedAt"] = ago(30).isoformat()  # type: ignore[index]
    assert recorded_job(VM.from_body(body)) == JobRecord(
        job_id=5, workflow_run_id=9, repository="o/r", started_at=ago(30)
    )
    assert recorded_job(VM.from_body({**body, "status": None})) == JobRecord()
    assert not VM.from_body({**body, "status": {"phase": "Running"}}).has_job


def test_run_and_job_from_github_json() -> None:
    run = RunInfo.from_json(
        {
            "id": 42,
            "status": "completed",
            "conclusion": "cancelled",
            "updated_at": "2026-03-01T11:00:00Z",
        }
    )
    assert run == RunInfo(status="completed", conclusion="cancelled", updated_at=ago(HOUR))
    job = JobInfo.from_json(
        {
            "status": "in_progress",
            "conclusion": None,
            "started_at": "2026-03-01T11:59:00Z",
            "completed_at": None,
        }
    )
    assert job == JobInfo(status="in_progress", started_at=ago(60))
    with pytest.raises(KeyError):
        RunInfo.from_json({"status": "completed"})
    with pytest.raises(ValueError):
        RunInfo.from_json({"status": "completed", "updated_at": "2026-03-01T11:00:00"})
    with pytest.raises(ValueError):
        RunInfo.from_json({"status": "completed", "updated_at": 17})


# --------------------------------------------------------------------------------------------
# Properties

STATUSES = st.sampled_from(["queued", "in_progress", "waiting", "completed"])
CONCLUSIONS = st.none() | st.sampled_from(["success", "failure", "cancelled", "timed_out"])
OFFSET = st.integers(-100, 20 * 86400)


@st.composite
def cases(draw: st.DrawFn) -> tuple[VM, RunInfo, JobInfo | None, int, int]:
    vm = reap_vm(
        name="vm",
        deleting=draw(st.booleans()),
        job_id=draw(st.none() | st.integers(1, 10**9)),
        workflow_run_id=draw(
            st.none() | st.integers(-5, 10**9) | st.text(max_size=6) | st.sampled_from(["42", "x"])
        ),
        repository=draw(st.none() | st.sampled_from(["o/r", "bad", "o/r/x", "O-1/r.x"])),
        job_started_at=draw(st.none() | OFFSET.map(ago)),
    )
    run = RunInfo(status=draw(STATUSES), conclusion=draw(CONCLUSIONS), updated_at=ago(draw(OFFSET)))
    job = draw(
        st.none()
        | st.builds(
            JobInfo,
            status=STATUSES,
            conclusion=CONCLUSIONS,
            started_at=st.none() | OFFSET.map(ago),
            completed_at=st.none() | OFFSET.map(ago),
        )
    )
    return vm, run, job, draw(st.integers(60, 7 * 86400)), draw(st.integers(0, 3600))


@given(cases())
def test_prop_judge_agrees_with_needs_lookup(
    case: tuple[VM, RunInfo, JobInfo | None, int, int],
) -> None:
    vm, run, job, max_job, grace = case
    first = needs_lookup(vm)
    v = judge(vm, run, job, NOW, max_job, grace)
    assert v.reason
    if isinstance(first, ReapVerdict):
        assert v == first
        assert v.action is not Action.DELETE
    if vm.deleting or not vm.has_job:
        assert v.action is Action.KEEP


@given(cases())
def test_prop_delete_only_on_positive_evidence(
    case: tuple[VM, RunInfo, JobInfo | None, int, int],
) -> None:
    vm, run, job, max_job, grace = case
    v = judge(vm, run, job, NOW, max_job, grace)
    if not v.delete:
        return
    if v.rule is Rule.RUN_COMPLETED:
        assert run.status == "completed"
        assert (NOW - run.updated_at).total_seconds() >= grace
    elif v.rule is Rule.JOB_COMPLETED:
        assert run.status != "completed" and job is not None and job.status == "completed"
        assert job.completed_at is not None
        assert (NOW - job.completed_at).total_seconds() >= grace
    else:
        assert v.rule is Rule.JOB_TOO_LONG
        started = job.started_at if job is not None and job.started_at else vm.job_started_at
        assert started is not None and (NOW - started).total_seconds() > max_job


@given(cases(), st.integers(0, 10 * 86400))
def test_prop_a_deletion_stays_a_deletion_as_time_passes(
    case: tuple[VM, RunInfo, JobInfo | None, int, int], later: int
) -> None:
    vm, run, job, max_job, grace = case
    if judge(vm, run, job, NOW, max_job, grace).delete:
        assert judge(vm, run, job, NOW + timedelta(seconds=later), max_job, grace).delete
