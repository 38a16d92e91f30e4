"""The node agent's decisions about one VM, as one pure function: ``next_steps(VMObservation) ->
VMSteps``. No I/O: the agent shell (:mod:`impvm.agent.agent`) observes (watch caches, the
runtime, what it did itself), calls :func:`next_steps`, carries out the steps in order and
decides again; a step that fails leaves the rest undone and the next decision starts from what is
observed then (level-triggered, like a Kubernetes controller).

The ladder, first match wins (each rung names its :class:`Why`):

1. the VM is gone: stop and clean up what this agent still runs for it;
2. unbound, or bound to another node: nothing to do (the operator places VMs,
   :mod:`impvm.scaling.placement`; the API server refuses an agent any write to a VM not
   bound to its node);
3. being deleted, or finished (Succeeded/Failed): stop, clean up, and only then release the
   finalizer (never before the runtime reported the VM stopped and its files are removed);
4. bound here without the finalizer: admit it, as the kubelet admits a pod: refuse a VM whose
   ImpVMClass is missing (condition ``ClassMissing`` naming the class, and an Event); fail it
   while the host preflight fails (``NodePreflightFailed``) or when it does not fit the
   node's free capacity (``OutOfCapacity``); else add the finalizer (from then on it holds
   capacity here);
5. not started (no phase, Pending, Scheduled): report Scheduled, prepare the image (pull by
   digest, verify, check signatures when the VM requires them, unpack), wait for the JIT
   config Secret, start;
6. started (Starting, Running): report Running; finish with the runner's exit (Succeeded on 0);
   fail on the ``expireAfter`` deadline (DeadlineExceeded), on a start that takes longer than
   the start timeout (StartTimeout), or when the runtime no longer knows the VM (Lost).

After an agent restart nothing of :class:`LocalFacts` is left, and none is needed: a runtime whose
VMs outlive the agent process (``qemu``) re-attaches a VM it finds running when first asked about
it, so the runtime reports ``starting``/``running`` and rung 6 carries on watching it (no second
:class:`Start`, so no second JIT config; a VM still in a not-started phase is reported started by
rung 5), or ``exited`` with the exit code the VM reported while no agent ran, which rung 6 reports
as for any exit. Only a VM the runtime cannot re-attach (``missing``: the ``process`` runtime's
sandboxes die with the agent) is Lost.

The VM's own network (:mod:`impvm.agent.network`) sits at the two ends of the runtime's run: the
runtime attaches it inside :class:`Start` just before the launch and detaches it inside
:class:`Cleanup` just after the stop (:class:`~impvm.agent.runtime_base.RuntimeBase`), so a failed
attach is a StartFailed like any other and every path that cleans a VM up removes its network.

Where later capabilities slot in, without reshaping: a failing host preflight already gates
admission (:class:`Preflight`); signature verification is part of :class:`Prepare`
(a refusal arrives as :attr:`LocalFacts.failure`, every outcome as
:attr:`LocalFacts.verification`, reported in the ``ImageVerified`` condition); keeping the
console of a failed VM is an option of :class:`Cleanup` chosen in :func:`_fail`/:func:`_finish`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from impvm.agent.capacity import Resources, fits
from impvm.agent.runtime import RuntimeState, Verification
from impvm.api.conditions import set_condition
from impvm.api.durations import resolve_expire_after
from impvm.api.models import AGENT_FINALIZER, TERMINAL_PHASES, VMPhase
from impvm.api.times import k8s_time
from impvm.api.vm import VM

#: Phases of a VM the runtime has not been asked to start.
NOT_STARTED: frozenset[VMPhase | None] = frozenset({None, VMPhase.PENDING, VMPhase.SCHEDULED})
#: Condition an agent sets on a VM whose ImpVMClass does not exist.
CLASS_MISSING = "ClassMissing"
#: Condition reporting the signature check of a VM's image and runner layer.
IMAGE_VERIFIED = "ImageVerified"
#: How much of a console tail or failure message goes into ``status.message`` / an Event.
MESSAGE_CHARS = 2000
#: console lines a failed VM's status carries (``status.consoleTail``)
CONSOLE_TAIL_LINES = 20
EVENT_CHARS = 500


# ---------------------------------------------------------------------------------- what is seen


@dataclass(frozen=True)
class Preflight:
    """Whether this host can run VMs at all (``reason`` says why not). An agent whose runtime
    cannot work admits no VM. ``warning``: what the checks warned about (e.g. unisolated
    guests), shown with the verdict but gating nothing."""

    ok: bool = True
    reason: str = ""
    warning: str = ""


@dataclass(frozen=True)
class Policy:
    """The agent's settings that decisions use (seconds)."""

    runtime_name: str = "process"
    tick_seconds: float = 1.0
    start_timeout_seconds: float = 300.0
    stop_grace_seconds: float = 10.0
    jit_retry_seconds: float = 2.0
    #: where the consoles of failed VMs are kept on this node ("": not kept)
    console_dir: str = ""


@dataclass(frozen=True)
class LocalFacts:
    """What this agent did for one VM and learnt doing it. Kept in memory by the shell and
    forgotten with the VM; all unset after an agent restart.

    ``prepared``: its image is ready; ``failure``: ``(exitReason, message)`` of a prepare or
    start that failed; ``jit_missing_at``: when a start found no JIT config in the VM's Secret;
    ``cleaned``: the runtime removed everything of the VM since it last ran;
    ``verification``: the outcome of the signature check of a VM whose spec has ``verify``
    (made in :class:`Prepare`; a refusal also sets ``failure``), reported in its
    ``ImageVerified`` condition.
    """

    prepared: bool = False
    failure: tuple[str, str] | None = None
    jit_missing_at: datetime | None = None
    cleaned: bool = False
    verification: Verification | None = None


@dataclass(frozen=True)
class VMObservation:
    """Everything :func:`next_steps` looks at for one VM.

    ``vm``: the VM (None when it is gone); ``size``: its class's vCPU/MiB (None when the class
    does not exist); ``runtime``: what the runtime reports (status ``missing`` when it knows
    nothing of the VM); ``capacity``: the node's; ``used``: by the other VMs bound here and not
    released; ``now``: the one clock.
    """

    node: str
    now: datetime
    vm: VM | None
    size: Resources | None
    runtime: RuntimeState
    capacity: Resources
    used: Resources
    local: LocalFacts = field(default_factory=LocalFacts)
    preflight: Preflight = field(default_factory=Preflight)
    policy: Policy = field(default_factory=Policy)


# ---------------------------------------------------------------------------------- what is done


@dataclass(frozen=True)
class AddFinalizer:
    """Add the agent finalizer (conditional on the observed resourceVersion)."""


@dataclass(frozen=True)
class PatchStatus:
    """Merge ``fields`` into ``status`` (wire names and values)."""

    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Emit:
    """Record a Kubernetes Event about the VM."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Prepare:
    """Make the image and runner layer ready (the runtime's ``prepare``, which checks their
    signatures when the VM requires it); a failure is remembered as :attr:`LocalFacts.failure`
    (ImagePullFailed, or the signature refusal's reason), a signature check's outcome as
    :attr:`LocalFacts.verification`."""


@dataclass(frozen=True)
class Start:
    """Read the JIT config from the VM's Secret and start the VM with it. No JIT config yet:
    remembered as :attr:`LocalFacts.jit_missing_at`; a failure as :attr:`LocalFacts.failure`
    (StartFailed)."""


@dataclass(frozen=True)
class Stop:
    """Stop the VM (graceful, killed after ``grace_seconds``)."""

    grace_seconds: float


@dataclass(frozen=True)
class KeepConsole:
    """Copy the VM's console, bounded and with its JIT config scrubbed, to ``path`` (before
    :class:`Cleanup` removes the original); old kept consoles beyond the node's bound go."""

    path: str


@dataclass(frozen=True)
class Cleanup:
    """Remove everything of the VM on this node (the runtime's ``cleanup``)."""


@dataclass(frozen=True)
class Release:
    """Remove the agent finalizer (conditional on the observed resourceVersion)."""


Step = AddFinalizer | PatchStatus | Emit | Prepare | Start | Stop | KeepConsole | Cleanup | Release


class Why(StrEnum):
    """Which rung of the ladder decided (for logs and tests)."""

    GONE = "gone"
    NOT_BOUND = "not-bound"
    CLASS_MISSING = "class-missing"
    PREFLIGHT_FAILED = "preflight-failed"
    NO_CAPACITY = "no-capacity"
    OTHER_NODE = "other-node"
    DELETING = "deleting"
    FINISHED = "finished"
    RELEASE = "release"
    ADOPT = "adopt"
    REPORT_STARTED = "report-started"
    START_FAILED = "start-failed"
    PREPARE = "prepare"
    WAIT_JIT = "wait-jit"
    START = "start"
    LOST = "lost"
    EXITED = "exited"
    DEADLINE = "deadline"
    REPORT_RUNNING = "report-running"
    START_TIMEOUT = "start-timeout"
    RUNNING = "running"
    STARTING = "starting"


@dataclass(frozen=True)
class VMSteps:
    """What to do for one VM: ``steps`` in order; then decide again after ``recheck_seconds``
    without an event (0: at once; None: only on an event), or, with ``forget``, drop every bit
    of state about the VM (a later event about it starts afresh)."""

    why: Why
    steps: tuple[Step, ...] = ()
    recheck_seconds: float | None = None
    forget: bool = False

    def has(self, kind: type) -> bool:
        """Whether a step of ``kind`` is in the action."""
        return any(isinstance(s, kind) for s in self.steps)


# ---------------------------------------------------------------------------------- the ladder


def next_steps(obs: VMObservation) -> VMSteps:
    """The next action for one VM (see the module docstring for the ladder)."""
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


def _refuse_class(obs: VMObservation, vm: VM, what: str) -> VMSteps:
    """A VM whose class does not exist has no size: it is not booted. The
    condition (and one Event) says which class is missing; when it appears, the class's watch
    brings the VM back."""
    current = vm.condition(CLASS_MISSING)
    if current is not None and current.status == "True" and current.reason == "NotFound":
        return VMSteps(Why.CLASS_MISSING, forget=True)
    message = f"ImpVMClass {vm.class_name!r} not found; the VM is not {what} until it exists"
    conditions = _set_condition(vm, CLASS_MISSING, True, "NotFound", message, obs.now)
    steps: tuple[Step, ...] = (
        PatchStatus({"conditions": conditions}),
        Emit("ClassNotFound", message, warning=True),
    )
    return VMSteps(Why.CLASS_MISSING, steps, forget=True)


def _class_found(obs: VMObservation, vm: VM) -> dict[str, Any]:
    """Status fields that clear a ``ClassMissing`` condition once the class exists."""
    current = vm.condition(CLASS_MISSING)
    if current is None or current.status != "True":
        return {}
    message = f"ImpVMClass {vm.class_name!r} found"
    return {"conditions": _set_condition(vm, CLASS_MISSING, False, "Found", message, obs.now)}


def _verified(
    obs: VMObservation, vm: VM, conditions: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """Status fields setting the ``ImageVerified`` condition from the signature check this
    agent made (on top of ``conditions`` when this decision already changes others); ``{}``
    when there is none or the VM already shows it."""
    v = obs.local.verification
    if v is None:
        return {}
    current = vm.condition(IMAGE_VERIFIED)
    value = "True" if v.verified else "False"
    if current is not None and (current.status, current.reason, current.message) == (
        value,
        v.reason,
        v.message,
    ):
        return {}
    return {
        "conditions": _set_condition(
            vm, IMAGE_VERIFIED, v.verified, v.reason, v.message, obs.now, conditions
        )
    }


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


def _finish(obs: VMObservation, rt: RuntimeState) -> VMSteps:
    """The runner exited: report it (Succeeded on 0, else Failed with the console tail) and
    clean up. The code is the VM's word (a job can choose it): it is shown and decides only
    which of the two is reported."""
    code = rt.exit_code if rt.exit_code is not None else -1
    status: dict[str, Any] = {
        "phase": VMPhase.SUCCEEDED if code == 0 else VMPhase.FAILED,
        "exitCode": code,
        "exitReason": "Completed" if code == 0 else "Error",
        "finishedAt": k8s_time(rt.finished_at or obs.now),
        "timings": {"finishedAt": k8s_time(rt.finished_at or obs.now)},
    }
    if code == 0:
        steps: tuple[Step, ...] = (
            PatchStatus(status),
            Emit("Succeeded", "runner exited 0 (as its VM reported)"),
        )
    else:
        status["message"] = rt.log_tail[-MESSAGE_CHARS:]
        keep, extra = _keep_console(obs, rt.log_tail)
        status |= extra
        steps = (
            *keep,
            PatchStatus(status),
            Emit("Failed", f"runner exited {code} (as its VM reported)", warning=True),
            *_console_event(obs, extra),
        )
    return VMSteps(Why.EXITED, (*steps, Cleanup()), recheck_seconds=0)


def console_tail(text: str) -> str:
    """The last :data:`CONSOLE_TAIL_LINES` lines of ``text``, at most :data:`MESSAGE_CHARS`."""
    return "\n".join(text.splitlines()[-CONSOLE_TAIL_LINES:])[-MESSAGE_CHARS:]


def _keep_console(obs: VMObservation, tail: str) -> tuple[tuple[Step, ...], dict[str, Any]]:
    """The step keeping a failed VM's console and the status fields naming it: ``consoleTail``
    (its last lines) and ``consoleLog`` (``<node>:<path>``)."""
    fields: dict[str, Any] = {}
    if tail:
        fields["consoleTail"] = console_tail(tail)
    if not obs.policy.console_dir or obs.vm is None:
        return (), fields
    path = f"{obs.policy.console_dir}/{obs.vm.vm_id}.log"
    fields["consoleLog"] = f"{obs.node}:{path}"
    return (KeepConsole(path),), fields


def _console_event(obs: VMObservation, fields: Mapping[str, Any]) -> tuple[Step, ...]:
    """The Event saying where the full console is."""
    where = fields.get("consoleLog")
    if not where or obs.vm is None:
        return ()
    node, _, path = str(where).partition(":")
    text = (
        f"console log kept on node {node} at {path}; impvm logs -n {obs.vm.namespace} {obs.vm.name}"
    )
    return (Emit("ConsoleLogKept", text),)


def _fail(
    obs: VMObservation,
    why: Why,
    reason: str,
    message: str,
    *,
    stop: bool = False,
    before: Sequence[Step] = (),
) -> VMSteps:
    """Fail the VM with ``reason`` (its ``exitReason``) and ``message``: stop it first when it
    may still run, report, tell, clean up."""
    steps: list[Step] = list(before)
    if stop:
        steps.append(Stop(obs.policy.stop_grace_seconds))
    status: dict[str, Any] = {
        "phase": VMPhase.FAILED,
        "exitReason": reason,
        "finishedAt": k8s_time(obs.now),
        "timings": {"finishedAt": k8s_time(obs.now)},
        "message": message[-MESSAGE_CHARS:],
    }
    keep, extra = _keep_console(obs, obs.runtime.log_tail)
    status |= extra
    steps += [
        *keep,
        PatchStatus(status),
        Emit(reason, message[-EVENT_CHARS:], warning=True),
        *_console_event(obs, extra),
        Cleanup(),
    ]
    return VMSteps(why, tuple(steps), recheck_seconds=0)


def _set_condition(
    vm: VM,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    conditions: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The VM's conditions (wire form, sorted by type; ``conditions``: instead of the VM's, when
    this decision already changed them) with ``type_`` set (:func:`impvm.api.conditions.
    set_condition`: its lastTransitionTime moves only when its status flips)."""
    if conditions is None:
        conditions = [
            c.model_dump(by_alias=True, exclude_none=True, mode="json")
            for c in vm.status.conditions or ()
        ]
    return set_condition(conditions, type_, status, reason, message, now)
