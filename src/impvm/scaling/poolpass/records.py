"""What the pass copies onto its VMs' status (typed patches): what GitHub says of each runner
(an online runner whose registration vanished is offline), the job each runner took (from a
job record: ``runner_name``, job id, run id, repository, ``startedAt``, ``completedAt``; ARC's
jobId, workflowRunId, jobRepositoryName), which the reaper reads, and the per-job timings. Pure.

A runner first seen online, or first named by a job record as the one that started a job,
gets ``timings.runnerOnlineAt`` (its readiness): then or at the job's start, whichever the
pass learns first; a short job's runner may never be listed online at all."""

from __future__ import annotations

import datetime as dt

from impvm.api.models import ImpVMStatus, JobStatus, RunnerStatus, VMTimings
from impvm.api.patches import whole_seconds
from impvm.api.vm import VM
from impvm.scaling.jobs import Job
from impvm.scaling.poolpass.acts import PatchVMStatus
from impvm.scaling.poolpass.world import PoolWorld, RunnerView

__all__ = ["ready_at", "records"]


def ready_at(
    vm: VM, reg: RunnerView | None, job: Job | None, now: dt.datetime
) -> dt.datetime | None:
    """When the VM's runner was first ready, if the pass learns it now: GitHub lists it online
    or busy (now), or a job record names it as the runner of a job that started (the job's
    start); None when it was seen before or is not ready."""
    if vm.runner_seen:
        return None
    if job is not None and job.started_at is not None:
        return min(job.started_at, now)
    if reg is not None and (reg.online or reg.busy):
        return now
    return None


def _runner_part(vm: VM, reg: RunnerView | None) -> RunnerStatus | None:
    cur = vm.status.runner
    have = (cur.id, cur.name, cur.online, cur.busy) if cur else None
    if reg is not None:
        if have == (reg.id, reg.name, reg.online, reg.busy):
            return None
        return RunnerStatus(id=reg.id, name=reg.name, online=reg.online, busy=reg.busy)
    if cur is not None and cur.id is not None and (cur.online or cur.busy):
        return RunnerStatus(online=False, busy=False)  # the registration vanished
    return None


def _job_part(vm: VM, job: Job | None) -> JobStatus | None:
    if job is None or (vm.status.job is not None and vm.status.job.id == job.id):
        return None
    record = JobStatus(id=job.id, workflow_run_id=job.run_id, repository=job.repository)
    if job.started_at:
        record.started_at = whole_seconds(job.started_at)
    if job.completed_at:
        record.completed_at = whole_seconds(job.completed_at)
    return record


def records(world: PoolWorld, skip: set[str], minted: set[str]) -> tuple[PatchVMStatus, ...]:
    """One patch per VM whose record changed (``skip``: VMs deleted this pass; ``minted``: VMs
    whose Secret is recorded this pass). Only VMs with a usable JIT Secret are recorded (a
    registration the VM cannot use is replaced by the next mint); nothing while GitHub's list
    is unknown."""
    runners = world.github.runners
    if runners is None:
        return ()
    by_name = {r.name: r for r in runners}
    out: list[PatchVMStatus] = []
    for vm in sorted(world.vms, key=lambda v: v.name):
        if vm.deleting or vm.name in skip:
            continue
        if vm.spec.runner_config_secret not in world.secrets and vm.name not in minted:
            continue
        reg, job = by_name.get(vm.name), world.job_on(vm.name)
        runner, record = _runner_part(vm, reg), _job_part(vm, job)
        ready = ready_at(vm, reg, job, world.now)
        if runner is None and record is None and ready is None:
            continue  # the common case: nothing new (no model is built for it)
        status = ImpVMStatus()
        observe: list[tuple[str, float]] = []
        if runner is not None:
            status.runner = runner
        if record is not None:
            status.job = record
        timings = VMTimings()
        if ready is not None:
            timings.created_at = whole_seconds(vm.created_at)
            timings.runner_online_at = whole_seconds(ready)
            took = max(0.0, (ready - vm.created_at).total_seconds())
            observe.append(("runnerRegistration", took))
        if record is not None and job is not None and job.started_at:
            timings.job_queued_at = whole_seconds(min(job.seen_at, job.started_at))
            timings.job_started_at = whole_seconds(job.started_at)
            if job.wait_seconds is not None:
                observe.append(("jobPickup", job.wait_seconds))
        if timings.model_fields_set:
            status.timings = timings
        out.append(PatchVMStatus(name=vm.name, status=status, observe=tuple(observe)))
    return tuple(out)
