"""What the ladder reports about a VM: its conditions (``ClassMissing``, ``ImageVerified``), a
failure or the runner's exit (status, Events, the console of a failed VM kept on the node), each
bounded to what a status or an Event carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from impvm.agent.lifecycle.observation import VMObservation
from impvm.agent.lifecycle.steps import (
    Cleanup,
    Emit,
    KeepConsole,
    PatchStatus,
    Step,
    Stop,
    VMSteps,
    Why,
)
from impvm.agent.runtime import RuntimeState
from impvm.api.conditions import set_condition
from impvm.api.models import VMPhase
from impvm.api.times import k8s_time
from impvm.api.vm import VM

#: Condition an agent sets on a VM whose ImpVMClass does not exist.
CLASS_MISSING = "ClassMissing"
#: Condition reporting the signature check of a VM's image and runner layer.
IMAGE_VERIFIED = "ImageVerified"
#: How much of a console tail or failure message goes into ``status.message`` / an Event.
MESSAGE_CHARS = 2000
#: console lines a failed VM's status carries (``status.consoleTail``)
CONSOLE_TAIL_LINES = 20
EVENT_CHARS = 500


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
