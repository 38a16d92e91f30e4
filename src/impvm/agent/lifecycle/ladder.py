"""The ladder of :func:`next_steps`, one function per rung (the package docstring of
:mod:`impvm.agent.lifecycle` describes it)."""

from __future__ import annotations

from typing import Any

from impvm.agent.capacity import fits
from impvm.agent.lifecycle.observation import NOT_STARTED, VMObservation
from impvm.agent.lifecycle.reports import _class_found, _fail, _finish, _refuse_class, _verified
from impvm.agent.lifecycle.steps import (
    AddFinalizer,
    Cleanup,
    Emit,
    PatchStatus,
    Prepare,
    Release,
    Start,
    Step,
    Stop,
    VMSteps,
    Why,
)
from impvm.api.durations import resolve_expire_after
from impvm.api.models import AGENT_FINALIZER, TERMINAL_PHASES, VMPhase
from impvm.api.times import k8s_time
from impvm.api.vm import VM


def next_steps(obs: VMObservation) -> VMSteps:
    """The next action for one VM (the ladder: the docstring of :mod:`impvm.agent.lifecycle`)."""
    vm = obs.vm
    if vm is None:
        return _gone(obs)
    if not vm.node_name:  # the operator places VMs; an agent never writes an unbound one
        return VMSteps(Why.NOT_BOUND, forget=True)
    if vm.node_name != obs.node:
        return VMSteps(Why.OTHER_NODE, forget=True)
    if vm.deleting:
        return _wind_down(obs, vm, Why.DELETING)
    if vm.phase in TERMINAL_PHASES:
        return _wind_down(obs, vm, Why.FINISHED)
    if AGENT_FINALIZER not in vm.finalizers:
        return _admit(obs, vm)
    if vm.phase in NOT_STARTED:
        return _boot(obs, vm)
    return _started(obs, vm)


def _gone(obs: VMObservation) -> VMSteps:
    """The VM no longer exists (its finalizer was removed by someone else, e.g. the operator
    after this node was thought lost): stop and clean up whatever still runs here."""
    rt = obs.runtime
    steps: list[Step] = []
    if rt.active:
        steps.append(Stop(obs.policy.stop_grace_seconds))
    if rt.status != "missing" or (obs.local.prepared and not obs.local.cleaned):
        steps.append(Cleanup())
    return VMSteps(Why.GONE, tuple(steps), forget=True)


def _admit(obs: VMObservation, vm: VM) -> VMSteps:
    """Bound here (by the operator's placement) and not yet taken: take it, by adding the
    finalizer, when this node can run it, as the kubelet admits a pod the scheduler bound. A
    VM whose class does not exist waits (``ClassMissing``); on a host whose checks failed, or
    without room for it (the operator's view of this node's capacity was behind), the VM fails
    (``NodePreflightFailed``, ``OutOfCapacity``, like the kubelet's ``OutOfcpu``) and its pool
    replaces it."""
    if (
        obs.runtime.status != "missing"
    ):  # it runs here already: this agent's finalizer write was lost
        return VMSteps(Why.ADOPT, (AddFinalizer(),), recheck_seconds=0)
    if obs.size is None:
        return _refuse_class(obs, vm, "booted")
    if not obs.preflight.ok:
        message = f"node {obs.node} runs no VM: its host checks failed: {obs.preflight.reason}"
        return _fail(obs, Why.PREFLIGHT_FAILED, "NodePreflightFailed", message)
    if not fits(obs.capacity, obs.used, obs.size):
        free_v = obs.capacity.vcpu - obs.used.vcpu
        free_m = obs.capacity.memory_mib - obs.used.memory_mib
        message = (
            f"node {obs.node} has {free_v} vCPU, {free_m} MiB free; the VM needs "
            f"{obs.size.vcpu} vCPU, {obs.size.memory_mib} MiB"
        )
        return _fail(obs, Why.NO_CAPACITY, "OutOfCapacity", message)
    return VMSteps(Why.ADOPT, (AddFinalizer(),), recheck_seconds=0)


def _wind_down(obs: VMObservation, vm: VM, why: Why) -> VMSteps:
    """Deleted or finished: stop, clean up, then (a later decision, once the runtime reports
    the VM stopped and this agent cleaned it up) release the finalizer."""
    rt = obs.runtime
    steps: list[Step] = []
    if vm.deleting and vm.phase not in TERMINAL_PHASES and vm.phase != VMPhase.TERMINATING:
        steps.append(PatchStatus({"phase": VMPhase.TERMINATING}))
    if rt.active:
        steps.append(Stop(obs.policy.stop_grace_seconds))
    if rt.active or not obs.local.cleaned:
        steps.append(Cleanup())
        return VMSteps(why, tuple(steps), recheck_seconds=0)
    if AGENT_FINALIZER in vm.finalizers:
        steps.append(Release())
        return VMSteps(Why.RELEASE, tuple(steps), forget=True)
    return VMSteps(why, tuple(steps), forget=True)


def _boot(obs: VMObservation, vm: VM) -> VMSteps:
    """Bound here, not started: report Scheduled, prepare, wait for the JIT config, start."""
    rt = obs.runtime
    if rt.status != "missing":  # started by this agent; the report did not land yet
        started = rt.started_at or obs.now
        steps_started: tuple[Step, ...] = (
            PatchStatus({"phase": VMPhase.STARTING, "startedAt": k8s_time(started)}),
            Emit("Started", f"runtime {obs.policy.runtime_name} started the VM"),
        )
        return VMSteps(Why.REPORT_STARTED, steps_started, recheck_seconds=0)
    if obs.size is None:
        return _refuse_class(obs, vm, "booted")
    steps: list[Step] = []
    report: dict[str, Any] = _class_found(obs, vm)
    report |= _verified(obs, vm, report.get("conditions"))
    if vm.phase != VMPhase.SCHEDULED:
        report |= {
            "phase": VMPhase.SCHEDULED,
            "nodeName": obs.node,
            "timings": {"scheduledAt": k8s_time(obs.now)},
        }
    if report:
        steps.append(PatchStatus(report))
    local = obs.local
    if local.failure is not None:
        reason, message = local.failure
        return _fail(obs, Why.START_FAILED, reason, message, stop=False, before=steps)
    if not local.prepared:
        return VMSteps(Why.PREPARE, (*steps, Prepare()), recheck_seconds=0)
    if not vm.spec.runner_config_secret:  # the operator attaches it once minted
        return VMSteps(Why.WAIT_JIT, tuple(steps))
    if local.jit_missing_at is not None:
        waited = (obs.now - local.jit_missing_at).total_seconds()
        if waited < obs.policy.jit_retry_seconds:
            left = obs.policy.jit_retry_seconds - waited
            return VMSteps(Why.WAIT_JIT, tuple(steps), recheck_seconds=left)
    return VMSteps(Why.START, (*steps, Start()), recheck_seconds=0)


def _started(obs: VMObservation, vm: VM) -> VMSteps:
    """Started: follow the runtime until the runner exits, the deadline passes, the start
    times out or the runtime loses the VM."""
    rt = obs.runtime
    if rt.status == "missing":
        return _fail(
            obs, Why.LOST, "Lost", "the runtime no longer knows this VM (lost in an agent restart?)"
        )
    if rt.status == "exited":
        return _finish(obs, rt)
    started = vm.status.started_at or rt.started_at
    running_for = (obs.now - started).total_seconds() if started else 0.0
    expire = resolve_expire_after(vm.spec.expire_after)
    if expire and started and running_for >= expire:
        message = f"expireAfter {vm.spec.expire_after} passed"
        return _fail(obs, Why.DEADLINE, "DeadlineExceeded", message, stop=True)
    tick = obs.policy.tick_seconds
    if rt.status == "running":
        if vm.phase != VMPhase.RUNNING:
            booted = {"phase": VMPhase.RUNNING, "timings": {"bootedAt": k8s_time(obs.now)}}
            return VMSteps(Why.REPORT_RUNNING, (PatchStatus(booted),), tick)
        return VMSteps(Why.RUNNING, recheck_seconds=tick)
    if started and running_for >= obs.policy.start_timeout_seconds:
        return _fail(obs, Why.START_TIMEOUT, "StartTimeout", rt.log_tail, stop=True)
    return VMSteps(Why.STARTING, recheck_seconds=tick)
