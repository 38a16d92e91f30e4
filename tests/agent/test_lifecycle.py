"""The agent's pure lifecycle decision (impvm.agent.lifecycle.next_steps): every rung of the ladder
row by row, an exhaustive sweep over phases x runtime states x deletion x deadline x capacity x
binding x class x cleanup checking the rules that hold everywhere, and property tests (hypothesis)
that drive one VM through a simulated world until it is gone."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impvm.agent.capacity import Resources
from impvm.agent.lifecycle import (
    CLASS_MISSING,
    IMAGE_VERIFIED,
    AddFinalizer,
    Cleanup,
    Emit,
    KeepConsole,
    LocalFacts,
    PatchStatus,
    Policy,
    Preflight,
    Prepare,
    Release,
    Start,
    Stop,
    VMObservation,
    VMSteps,
    Why,
    console_tail,
    next_steps,
)
from impvm.agent.runtime import RuntimeState, Verification
from impvm.api.models import AGENT_FINALIZER, TERMINAL_PHASES
from impvm.api.times import k8s_time
from impvm.api.vm import VM

NODE = "node-a"
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
SIZE = Resources(2, 2048)
CAPACITY = Resources(4, 4096)
POLICY = Policy(runtime_name="process", tick_seconds=1.0, start_timeout_seconds=300.0)
PHASES = [None, "Pending", "Scheduled", "Starting", "Running", "Succeeded", "Failed", "Terminating"]
RUNTIME = {
    "missing": RuntimeState("missing"),
    "starting": RuntimeState("starting", started_at=NOW - timedelta(seconds=5), log_tail="boot"),
    "running": RuntimeState("running", started_at=NOW - timedelta(seconds=5), log_tail="up"),
    "exited-0": RuntimeState("exited", exit_code=0, started_at=NOW, finished_at=NOW),
    "exited-3": RuntimeState("exited", exit_code=3, finished_at=NOW, log_tail="line\nboom"),
}


def record(
    *,
    phase: str | None = None,
    node: str | None = NODE,
    deleting: bool = False,
    finalizer: bool = True,
    secret: str | None = "vm-jit",
    expire: str | None = None,
    started_at: datetime | None = None,
    conditions: list[dict[str, Any]] | None = None,
    cls: str = "small",
) -> VM:
    """An ImpVM as the API server sends it, parsed the way the agent parses it."""
    meta: dict[str, Any] = {
        "name": "vm-1",
        "namespace": "ci",
        "uid": "0123456789abcdef",
        "resourceVersion": "42",
        "finalizers": [AGENT_FINALIZER] if finalizer else [],
    }
    if deleting:
        meta["deletionTimestamp"] = k8s_time(NOW)
    spec: dict[str, Any] = {"classRef": {"name": cls}, "image": "reg/base@sha256:" + "0" * 64}
    if node is not None:
        spec["nodeName"] = node
    if secret:
        spec["runnerConfigSecret"] = secret
    if expire:
        spec["expireAfter"] = expire
    status: dict[str, Any] = {}
    if phase:
        status["phase"] = phase
    if started_at:
        status["startedAt"] = k8s_time(started_at)
    if conditions:
        status["conditions"] = conditions
    return VM.from_body({"metadata": meta, "spec": spec, "status": status})


def observe(
    vm: VM | None,
    runtime: str | RuntimeState = "missing",
    *,
    size: Resources | None = SIZE,
    used: Resources = Resources(0, 0),
    local: LocalFacts | None = None,
    preflight: Preflight | None = None,
    now: datetime = NOW,
) -> VMObservation:
    return VMObservation(
        node=NODE,
        now=now,
        vm=vm,
        size=size,
        runtime=RUNTIME[runtime] if isinstance(runtime, str) else runtime,
        capacity=CAPACITY,
        used=used,
        local=local or LocalFacts(),
        preflight=preflight or Preflight(),
        policy=POLICY,
    )


def kinds(action: VMSteps) -> list[str]:
    return [type(s).__name__ for s in action.steps]


def status_of(action: VMSteps) -> dict[str, Any]:
    """The status fields the action writes, merged in order."""
    out: dict[str, Any] = {}
    for s in action.steps:
        if isinstance(s, PatchStatus):
            out.update(s.fields)
    return out


def events_of(action: VMSteps) -> list[tuple[str, bool]]:
    return [(s.reason, s.warning) for s in action.steps if isinstance(s, Emit)]


PREPARED = LocalFacts(prepared=True)
CLEANED = LocalFacts(prepared=True, cleaned=True)
LONG_AGO = NOW - timedelta(minutes=10)


# ------------------------------------------------------------------------------ rung by rung


@pytest.mark.parametrize(
    ("name", "obs", "why", "steps", "forget", "recheck"),
    [
        # 1. gone
        ("gone, never known", observe(None), Why.GONE, [], True, None),
        (
            "gone while running here",
            observe(None, "running", local=PREPARED),
            Why.GONE,
            ["Stop", "Cleanup"],
            True,
            None,
        ),
        ("gone after exit", observe(None, "exited-0"), Why.GONE, ["Cleanup"], True, None),
        ("gone, prepared only", observe(None, local=PREPARED), Why.GONE, ["Cleanup"], True, None),
        ("gone, cleaned", observe(None, local=CLEANED), Why.GONE, [], True, None),
        # 2. unbound: the operator places VMs, an agent never writes one
        ("unbound", observe(record(node=None, finalizer=False)), Why.NOT_BOUND, [], True, None),
        (
            "unbound, being deleted",
            observe(record(node=None, finalizer=False, deleting=True)),
            Why.NOT_BOUND,
            [],
            True,
            None,
        ),
        ("empty nodeName is unbound", observe(record(node="")), Why.NOT_BOUND, [], True, None),
        # 3. another node
        ("bound elsewhere", observe(record(node="node-b")), Why.OTHER_NODE, [], True, None),
        # 4. deleting / finished
        (
            "deleting while running",
            observe(record(phase="Running", deleting=True), "running", local=PREPARED),
            Why.DELETING,
            ["PatchStatus", "Stop", "Cleanup"],
            False,
            0,
        ),
        (
            "deleting, already Terminating, stopped",
            observe(record(phase="Terminating", deleting=True), "exited-3"),
            Why.DELETING,
            ["Cleanup"],
            False,
            0,
        ),
        (
            "deleting, cleaned: release",
            observe(record(phase="Terminating", deleting=True), local=CLEANED),
            Why.RELEASE,
            ["Release"],
            True,
            None,
        ),
        (
            "deleting, cleaned, released",
            observe(record(phase="Terminating", deleting=True, finalizer=False), local=CLEANED),
            Why.DELETING,
            [],
            True,
            None,
        ),
        (
            "deleting before start, never cleaned",
            observe(record(phase="Scheduled", deleting=True)),
            Why.DELETING,
            ["PatchStatus", "Cleanup"],
            False,
            0,
        ),
        (
            "succeeded, cleaned: release",
            observe(record(phase="Succeeded"), local=CLEANED),
            Why.RELEASE,
            ["Release"],
            True,
            None,
        ),
        (
            "failed by the operator while still running here",
            observe(record(phase="Failed"), "running", local=PREPARED),
            Why.FINISHED,
            ["Stop", "Cleanup"],
            False,
            0,
        ),
        (
            "finished after an agent restart",
            observe(record(phase="Failed")),
            Why.FINISHED,
            ["Cleanup"],
            False,
            0,
        ),
        # 5. bound here, not admitted yet
        ("bound, fits", observe(record(finalizer=False)), Why.ADOPT, ["AddFinalizer"], False, 0),
        (
            "bound, fits exactly",
            observe(record(finalizer=False), used=Resources(2, 2048)),
            Why.ADOPT,
            ["AddFinalizer"],
            False,
            0,
        ),
        (
            "bound, no vCPU left",
            observe(record(finalizer=False), used=Resources(3, 0)),
            Why.NO_CAPACITY,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "bound, no memory left",
            observe(record(finalizer=False), used=Resources(0, 3000)),
            Why.NO_CAPACITY,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "bound, preflight failed",
            observe(record(finalizer=False), preflight=Preflight(False, "no kvm")),
            Why.PREFLIGHT_FAILED,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "bound, class missing",
            observe(record(finalizer=False), size=None),
            Why.CLASS_MISSING,
            ["PatchStatus", "Emit"],
            True,
            None,
        ),
        # 6. not started
        (
            "admitted, not prepared",
            observe(record(phase="Scheduled")),
            Why.PREPARE,
            ["Prepare"],
            False,
            0,
        ),
        (
            "bound, no phase yet: report Scheduled and prepare",
            observe(record()),
            Why.PREPARE,
            ["PatchStatus", "Prepare"],
            False,
            0,
        ),
        (
            "prepared, JIT config not attached",
            observe(record(phase="Scheduled", secret=None), local=PREPARED),
            Why.WAIT_JIT,
            [],
            False,
            None,
        ),
        (
            "prepared, JIT config attached",
            observe(record(phase="Scheduled"), local=PREPARED),
            Why.START,
            ["Start"],
            False,
            0,
        ),
        (
            "JIT Secret missing a moment ago",
            observe(
                record(phase="Scheduled"),
                local=replace(PREPARED, jit_missing_at=NOW - timedelta(seconds=0.5)),
            ),
            Why.WAIT_JIT,
            [],
            False,
            1.5,
        ),
        (
            "JIT Secret missing a while ago: try again",
            observe(
                record(phase="Scheduled"),
                local=replace(PREPARED, jit_missing_at=NOW - timedelta(seconds=3)),
            ),
            Why.START,
            ["Start"],
            False,
            0,
        ),
        (
            "image pull failed",
            observe(record(phase="Scheduled"), local=LocalFacts(failure=("ImagePullFailed", "x"))),
            Why.START_FAILED,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "started, report lost",
            observe(record(phase="Scheduled"), "starting", local=PREPARED),
            Why.REPORT_STARTED,
            ["PatchStatus", "Emit"],
            False,
            0,
        ),
        (
            "bound, class missing",
            observe(record(phase="Scheduled"), size=None),
            Why.CLASS_MISSING,
            ["PatchStatus", "Emit"],
            True,
            None,
        ),
        # 7. started
        (
            "starting",
            observe(record(phase="Starting", started_at=NOW), "starting"),
            Why.STARTING,
            [],
            False,
            1.0,
        ),
        (
            "runner up",
            observe(record(phase="Starting", started_at=NOW), "running"),
            Why.REPORT_RUNNING,
            ["PatchStatus"],
            False,
            1.0,
        ),
        (
            "running",
            observe(record(phase="Running", started_at=NOW), "running"),
            Why.RUNNING,
            [],
            False,
            1.0,
        ),
        (
            "exit 0",
            observe(record(phase="Running", started_at=NOW), "exited-0"),
            Why.EXITED,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "start timeout",
            observe(record(phase="Starting", started_at=LONG_AGO), "starting"),
            Why.START_TIMEOUT,
            ["Stop", "PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "deadline",
            observe(record(phase="Running", started_at=LONG_AGO, expire="60s"), "running"),
            Why.DEADLINE,
            ["Stop", "PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
        (
            "deadline 0s means none",
            observe(record(phase="Running", started_at=LONG_AGO, expire="0s"), "running"),
            Why.RUNNING,
            [],
            False,
            1.0,
        ),
        (
            "runtime lost it",
            observe(record(phase="Running", started_at=NOW)),
            Why.LOST,
            ["PatchStatus", "Emit", "Cleanup"],
            False,
            0,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_rung(
    name: str,
    obs: VMObservation,
    why: Why,
    steps: list[str] | None,
    forget: bool,
    recheck: float | None,
) -> None:
    action = next_steps(obs)
    assert action.why is why, (name, action)
    if steps is not None:
        assert kinds(action) == steps, (name, action)
    assert action.forget is forget, (name, action)
    if recheck is not None and recheck > 0:
        assert action.recheck_seconds == pytest.approx(recheck)
    else:
        assert action.recheck_seconds == recheck, (name, action)


def test_a_vm_that_does_not_fit_fails_with_the_free_and_needed_capacity() -> None:
    """Like the kubelet's OutOfcpu: the VM fails (its pool replaces it) and says why."""
    action = next_steps(observe(record(finalizer=False), used=Resources(3, 0)))
    status = status_of(action)
    assert (status["phase"], status["exitReason"]) == ("Failed", "OutOfCapacity")
    assert "1 vCPU, 4096 MiB free" in status["message"] and "needs 2 vCPU" in status["message"]
    assert events_of(action) == [("OutOfCapacity", True)]
    assert not action.has(AddFinalizer)


def test_an_admitted_vm_reports_scheduled() -> None:
    action = next_steps(observe(record(phase=None)))
    assert status_of(action)["phase"] == "Scheduled"
    assert status_of(action)["nodeName"] == NODE


def test_missing_class_is_refused_by_name_once() -> None:
    """No fallback size: the VM is not admitted or booted, a condition and a Warning name
    the class, and a VM that already carries the condition gets no second write or Event."""
    for vm, what in [
        (record(finalizer=False, cls="gone-class"), "booted"),
        (record(phase="Scheduled", cls="gone-class"), "booted"),
    ]:
        action = next_steps(observe(vm, size=None))
        assert not action.has(AddFinalizer) and not action.has(Start) and not action.has(Prepare)
        (cond,) = status_of(action)["conditions"]
        assert (cond["type"], cond["status"], cond["reason"]) == (CLASS_MISSING, "True", "NotFound")
        assert "'gone-class'" in cond["message"] and what in cond["message"]
        assert cond["lastTransitionTime"] == k8s_time(NOW)
        assert events_of(action) == [("ClassNotFound", True)]
        again = record(
            node=vm.node_name, finalizer=bool(vm.finalizers), phase=vm.phase, conditions=[cond]
        )
        repeat = next_steps(observe(again, size=None))
        assert repeat.why is Why.CLASS_MISSING and repeat.steps == ()


def test_class_found_again_clears_the_condition() -> None:
    missing = {
        "type": CLASS_MISSING,
        "status": "True",
        "reason": "NotFound",
        "message": "x",
        "lastTransitionTime": "2026-04-01T00:00:00Z",
    }
    other = dict(missing, type="Zeta", reason="Other")
    for vm in [
        record(conditions=[missing, other]),
        record(phase="Scheduled", conditions=[missing, other]),
    ]:
        action = next_steps(observe(vm))
        conds = status_of(action)["conditions"]
        assert [c["type"] for c in conds] == [CLASS_MISSING, "Zeta"]  # others kept
        assert (conds[0]["status"], conds[0]["reason"]) == ("False", "Found")
        assert conds[0]["lastTransitionTime"] == k8s_time(NOW)
        assert conds[1] == other


def test_exit_reports() -> None:
    vm = record(phase="Running", started_at=NOW)
    ok = next_steps(observe(vm, "exited-0"))
    assert status_of(ok) == {
        "phase": "Succeeded",
        "exitCode": 0,
        "exitReason": "Completed",
        "finishedAt": k8s_time(NOW),
        "timings": {"finishedAt": k8s_time(NOW)},
    }
    assert events_of(ok) == [("Succeeded", False)]
    bad = next_steps(observe(vm, "exited-3"))
    assert status_of(bad) == {
        "phase": "Failed",
        "exitCode": 3,
        "exitReason": "Error",
        "finishedAt": k8s_time(NOW),
        "timings": {"finishedAt": k8s_time(NOW)},
        "message": "line\nboom",
        "consoleTail": "line\nboom",
    }
    assert events_of(bad) == [("Failed", True)]
    killed = next_steps(observe(vm, RuntimeState("exited")))
    assert status_of(killed)["exitCode"] == -1


@pytest.mark.parametrize(
    ("vm", "runtime", "stopped"),
    [
        (record(phase="Running", started_at=NOW), "exited-3", False),  # the runner failed
        (  # the start timed out: stopped first, so the kept console is complete
            record(phase="Starting", started_at=NOW - timedelta(seconds=301)),
            RuntimeState("starting", started_at=NOW, log_tail="booting\nhung"),
            True,
        ),
    ],
)
def test_a_failed_vm_keeps_its_console_and_says_where(
    vm: VM, runtime: RuntimeState | str, stopped: bool
) -> None:
    obs = replace(observe(vm, runtime), policy=replace(POLICY, console_dir="/var/lib/impvm/c"))
    act = next_steps(obs)
    path = f"/var/lib/impvm/c/{vm.vm_id}.log"
    steps = kinds(act)
    assert steps[-1] == "Cleanup" and steps.index("KeepConsole") < steps.index("PatchStatus")
    assert (steps.index("Stop") < steps.index("KeepConsole")) if stopped else "Stop" not in steps
    assert [s.path for s in act.steps if isinstance(s, KeepConsole)] == [path]
    status = status_of(act)
    assert status["consoleLog"] == f"{NODE}:{path}" and status["consoleTail"]
    (kept,) = [s for s in act.steps if isinstance(s, Emit) and s.reason == "ConsoleLogKept"]
    assert f"on node {NODE} at {path};" in kept.message and not kept.warning
    assert f"impvm logs -n {vm.namespace} {vm.name}" in kept.message


def test_console_tail_is_bounded() -> None:
    text = "\n".join(f"line {i} " + "x" * 300 for i in range(100))
    tail = console_tail(text)
    assert len(tail) <= 2000 and tail.endswith("x" * 300) and "line 99" in tail
    assert console_tail("a\nb") == "a\nb"


def test_failures_name_their_reason_and_bound_their_message() -> None:
    long = "x" * 5000
    rows = [
        (
            observe(record(phase="Running", started_at=LONG_AGO, expire="5m"), "running"),
            "DeadlineExceeded",
        ),
        (
            observe(
                record(phase="Starting", started_at=LONG_AGO),
                RuntimeState("starting", log_tail=long),
            ),
            "StartTimeout",
        ),
        (observe(record(phase="Running", started_at=NOW)), "Lost"),
        (
            observe(record(phase="Scheduled"), local=LocalFacts(failure=("StartFailed", long))),
            "StartFailed",
        ),
    ]
    for obs, reason in rows:
        action = next_steps(obs)
        status = status_of(action)
        assert status["phase"] == "Failed" and status["exitReason"] == reason
        assert status["finishedAt"] == k8s_time(NOW) and len(status["message"]) <= 2000
        (ev,) = [s for s in action.steps if isinstance(s, Emit)]
        assert ev.reason == reason and ev.warning and len(ev.message) <= 500
        assert action.steps[-1] == Cleanup()
    deadline = next_steps(rows[0][0])
    assert "expireAfter 5m passed" in status_of(deadline)["message"]
    assert deadline.steps[0] == Stop(POLICY.stop_grace_seconds)


def test_deadline_counts_from_the_recorded_start() -> None:
    vm = record(phase="Running", started_at=NOW - timedelta(seconds=59), expire="60s")
    assert next_steps(observe(vm, "running")).why is Why.RUNNING
    assert next_steps(observe(vm, "running", now=NOW + timedelta(seconds=1))).why is Why.DEADLINE


def test_start_timeout_boundary() -> None:
    vm = record(phase="Starting", started_at=NOW - timedelta(seconds=299))
    assert next_steps(observe(vm, "starting")).why is Why.STARTING
    assert (
        next_steps(observe(vm, "starting", now=NOW + timedelta(seconds=1))).why is Why.START_TIMEOUT
    )


def test_report_started_uses_the_runtime_start_time() -> None:
    action = next_steps(observe(record(phase="Scheduled"), "starting", local=PREPARED))
    started = RUNTIME["starting"].started_at
    assert started is not None
    assert status_of(action) == {"phase": "Starting", "startedAt": k8s_time(started)}
    assert events_of(action) == [("Started", False)]


def test_capacity_is_held_until_release() -> None:
    assert record().holds_capacity(NODE)
    assert not record(finalizer=False).holds_capacity(NODE)
    assert not record(node="node-b").holds_capacity(NODE)
    assert not record(node=None, finalizer=False).holds_capacity(NODE)


# ------------------------------------------------------------------------------ every combination


def _every_observation() -> list[VMObservation]:
    out = []
    for (
        phase,
        rt,
        deleting,
        clock,
        fits_,
        binding,
        size_known,
        local,
        finalizer,
    ) in itertools.product(
        PHASES,
        RUNTIME,
        (False, True),
        ("fresh", "late", "deadline"),
        (False, True),
        (None, NODE, "node-b"),
        (False, True),
        (LocalFacts(), PREPARED, CLEANED),
        (False, True),
    ):
        vm = record(
            phase=phase,
            node=binding,
            deleting=deleting,
            finalizer=finalizer,
            started_at=NOW if clock == "fresh" else LONG_AGO,
            expire="60s" if clock == "deadline" else None,
        )
        out.append(
            observe(
                vm,
                rt,
                size=SIZE if size_known else None,
                used=Resources(0, 0) if fits_ else CAPACITY,
                local=local,
            )
        )
    return out


EVERY = _every_observation()


def test_every_combination_keeps_the_rules() -> None:
    """Over phases x runtime states x deletion x clock (fresh, start timeout passed, deadline
    passed) x capacity x binding x class x local facts x finalizer (8 x 5 x 2 x 3 x 2 x 3 x 2 x
    3 x 2 = 17,280 observations)."""
    assert len(EVERY) == 17_280
    seen: set[Why] = set()
    for obs in EVERY:
        action = next_steps(obs)
        seen.add(action.why)
        _check_rules(obs, action)
    # every rung is reached by some combination (JIT waits need a missing Secret; see above)
    assert seen >= set(Why) - {Why.WAIT_JIT, Why.START_FAILED, Why.GONE, Why.PREFLIGHT_FAILED}


def _check_rules(obs: VMObservation, action: VMSteps) -> None:
    vm, rt = obs.vm, obs.runtime
    assert vm is not None
    steps = action.steps
    # the finalizer goes only once the runtime reported the VM stopped and it was cleaned up
    if action.has(Release):
        assert not rt.active and obs.local.cleaned, (obs, action)
        assert steps[-1] == Release()
    # admitted (the finalizer added) only: bound here, live, of a known class that fits, on a
    # working host (or already running here)
    if action.has(AddFinalizer) and rt.status == "missing":
        assert vm.node_name == NODE and not vm.deleting and vm.phase not in TERMINAL_PHASES
        assert obs.size is not None and obs.preflight.ok
        assert obs.used.vcpu + obs.size.vcpu <= obs.capacity.vcpu
        assert obs.used.memory_mib + obs.size.memory_mib <= obs.capacity.memory_mib
    # a start only for a VM bound here, of a known class, alive, not started, prepared
    if action.has(Start) or action.has(Prepare):
        assert vm.node_name == NODE and not vm.deleting and obs.size is not None
        assert vm.phase in (None, "Pending", "Scheduled") and rt.status == "missing"
        assert AGENT_FINALIZER in vm.finalizers
    if action.has(Start):
        assert obs.local.prepared and obs.local.failure is None
    # nothing is done to a VM of another node
    if vm.node_name and vm.node_name != NODE:
        assert steps == () and action.forget
    # nothing at all for an unbound VM: the operator binds, and no agent writes it
    if not vm.node_name:
        assert steps == () and action.forget
    # a VM is stopped before it is cleaned up, and cleaned up before it is forgotten
    if rt.active and action.has(Cleanup):
        assert any(isinstance(s, Stop) for s in steps[: steps.index(Cleanup())])
    if action.forget and vm.node_name == NODE:
        assert not rt.active and (
            obs.local.cleaned or action.has(Cleanup) or action.why in (Why.CLASS_MISSING,)
        ), (obs, action)
    # a finished VM never goes back to a live phase
    phase = status_of(action).get("phase")
    if vm.phase in TERMINAL_PHASES and phase is not None:
        assert phase in TERMINAL_PHASES
    # a deleted VM is never started, never re-reported as live
    if vm.deleting:
        assert not action.has(Start) and not action.has(AddFinalizer)
        assert phase in (None, "Terminating")
    # decide at once again after a step that changed something here (no wait for an event)
    if action.has(Cleanup) and not action.forget:
        assert action.recheck_seconds == 0


# ------------------------------------------------------------------------------ properties


observations = st.builds(
    lambda phase, rt, deleting, started_ago, expire, used, binding, size_known, facts, fin, preflight_ok: (
        observe(
            record(
                phase=phase,
                node=binding,
                deleting=deleting,
                finalizer=fin,
                started_at=NOW - timedelta(seconds=started_ago),
                expire=expire,
            ),
            rt,
            size=SIZE if size_known else None,
            used=used,
            local=facts,
            preflight=Preflight(preflight_ok, "" if preflight_ok else "no kvm"),
        )
    ),
    st.sampled_from(PHASES),
    st.sampled_from(sorted(RUNTIME)),
    st.booleans(),
    st.integers(0, 3600),
    st.sampled_from([None, "0s", "60s", "10m"]),
    st.builds(Resources, st.integers(0, 6), st.integers(0, 6000)),
    st.sampled_from([None, "", NODE, "node-b"]),
    st.booleans(),
    st.builds(
        LocalFacts,
        prepared=st.booleans(),
        failure=st.sampled_from([None, ("ImagePullFailed", "bad digest")]),
        jit_missing_at=st.sampled_from([None, NOW, NOW - timedelta(seconds=10)]),
        cleaned=st.booleans(),
    ),
    st.booleans(),
    st.booleans(),
)


@given(observations)
@settings(max_examples=1000, deadline=None)
def test_rules_hold_for_any_observation(obs: VMObservation) -> None:
    action = next_steps(obs)
    _check_rules(obs, action)
    if not obs.preflight.ok:
        assert not action.has(Start)
        assert not action.has(AddFinalizer) or obs.runtime.status != "missing"


@given(observations)
@settings(max_examples=500, deadline=None)
def test_decide_is_a_function_of_the_observation(obs: VMObservation) -> None:
    assert next_steps(obs) == next_steps(obs)


# A simulated world for one VM: the API server's view of it, the runtime, the JIT Secret, the
# clock. It applies steps the way the agent shell does; ``decide`` drives it.


@dataclass
class World:
    phase: str | None = None
    node: str | None = None
    finalizers: tuple[str, ...] = ()
    deleting: bool = False
    gone: bool = False
    secret: bool = False
    class_exists: bool = True
    started_at: datetime | None = None
    runtime: RuntimeState = RUNTIME["missing"]
    facts: LocalFacts = field(default_factory=LocalFacts)
    now: datetime = NOW
    expire: str | None = None
    image_ok: bool = True
    exit_code: int = 0
    releases_while_active: int = 0

    def record(self) -> VM | None:
        if self.gone:
            return None
        return record(
            phase=self.phase,
            node=self.node,
            deleting=self.deleting,
            finalizer=AGENT_FINALIZER in self.finalizers,
            secret="vm-jit" if self.secret else None,
            started_at=self.started_at,
            expire=self.expire,
        )

    def observation(self) -> VMObservation:
        return observe(
            self.record(),
            self.runtime,
            size=SIZE if self.class_exists else None,
            local=self.facts,
            now=self.now,
        )

    def apply(self, action: VMSteps) -> None:
        for step in action.steps:
            if isinstance(step, AddFinalizer):
                self.finalizers = (*self.finalizers, AGENT_FINALIZER)
            elif isinstance(step, PatchStatus):
                self.phase = step.fields.get("phase", self.phase)
                if "startedAt" in step.fields:
                    self.started_at = datetime.fromisoformat(step.fields["startedAt"])
            elif isinstance(step, Prepare):
                if self.image_ok:
                    self.facts = replace(self.facts, prepared=True)
                else:
                    self.facts = replace(self.facts, failure=("ImagePullFailed", "no"))
            elif isinstance(step, Start):
                if not self.secret:
                    self.facts = replace(self.facts, jit_missing_at=self.now)
                else:
                    self.runtime = RuntimeState("starting", started_at=self.now)
                    self.facts = replace(self.facts, cleaned=False, jit_missing_at=None)
            elif isinstance(step, Stop):
                if self.runtime.active:
                    self.runtime = RuntimeState("exited", exit_code=-1, finished_at=self.now)
            elif isinstance(step, Cleanup):
                self.runtime = RuntimeState("missing")
                self.facts = replace(self.facts, cleaned=True)
            elif isinstance(step, Release):
                if self.runtime.active or not self.facts.cleaned:
                    self.releases_while_active += 1
                self.finalizers = tuple(f for f in self.finalizers if f != AGENT_FINALIZER)
                if self.deleting:
                    self.gone = True
        if action.forget:  # the shell drops its facts
            self.facts = LocalFacts()

    def tick(self, seconds: float, runner_runs_for: float | None) -> None:
        """Time passes: the operator attaches the Secret, the runner starts and may exit."""
        self.now += timedelta(seconds=seconds)
        self.secret = True
        rt = self.runtime
        if rt.status == "starting":
            self.runtime = replace(rt, status="running")
        elif rt.status == "running" and runner_runs_for is not None and rt.started_at:
            if (self.now - rt.started_at).total_seconds() >= runner_runs_for:
                self.runtime = RuntimeState(
                    "exited",
                    exit_code=self.exit_code,
                    started_at=rt.started_at,
                    finished_at=self.now,
                )


@given(
    delete_after=st.integers(0, 40),
    runner_runs_for=st.sampled_from([None, 0.0, 5.0, 100.0]),
    expire=st.sampled_from([None, "60s"]),
    exit_code=st.sampled_from([0, 1]),
    image_ok=st.booleans(),
    class_exists=st.booleans(),
    prebound=st.booleans(),
    restart_at=st.sampled_from([None, 3, 7]),
)
@settings(max_examples=400, deadline=None)
def test_a_vm_always_ends_released_and_cleaned(
    delete_after: int,
    runner_runs_for: float | None,
    expire: str | None,
    exit_code: int,
    image_ok: bool,
    class_exists: bool,
    prebound: bool,
    restart_at: int | None,
) -> None:
    """Whatever happens (the runner exits or hangs, a deadline, a bad image, a missing class,
    an agent restart that forgets every local fact and loses the runtime), once the VM is
    deleted it is gone within a bounded number of decisions, it was never released while it
    ran, and nothing of it is left in the runtime."""
    w = World(
        node=NODE if prebound else None,
        expire=expire,
        exit_code=exit_code,
        image_ok=image_ok,
        class_exists=class_exists,
    )
    phases: list[str | None] = []
    for i in range(200):
        if i == delete_after:
            w.deleting = True
        if w.deleting and not w.finalizers:  # the API server removes it at once
            w.gone = True
        if i == restart_at:  # agent restart: local facts and the runtime's VMs are lost
            w.facts, w.runtime = LocalFacts(), RuntimeState("missing")
        if w.gone:
            break
        action = next_steps(w.observation())
        w.apply(action)
        phases.append(w.phase)
        if action.recheck_seconds != 0:
            w.tick(
                30.0 if action.recheck_seconds is None else action.recheck_seconds, runner_runs_for
            )
    assert w.gone, w
    assert w.releases_while_active == 0
    assert not w.runtime.active
    # phases move forward only: once finished, never live again
    finished = [p in TERMINAL_PHASES for p in phases]
    if True in finished:
        first = finished.index(True)
        assert all(p in TERMINAL_PHASES for p in phases[first:]), phases


def _status_of(action: VMSteps) -> dict[str, Any]:
    """The status fields of all the action's PatchStatus steps, merged in order."""
    out: dict[str, Any] = {}
    for step in action.steps:
        if isinstance(step, PatchStatus):
            out |= dict(step.fields)
    return out


def test_a_signature_check_is_reported_in_the_image_verified_condition() -> None:
    ok = Verification(True, "Verified", "image reg/base@sha256:0 signed by key sha256:f")
    local = LocalFacts(prepared=True, verification=ok)
    action = next_steps(observe(record(phase="Scheduled"), local=local))
    assert action.why is Why.START and isinstance(action.steps[-1], Start)
    (cond,) = _status_of(action)["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (IMAGE_VERIFIED, "True", "Verified")
    assert cond["message"] == ok.message and cond["lastTransitionTime"] == k8s_time(NOW)
    # once the VM shows it, it is not written again
    shown = next_steps(observe(record(phase="Scheduled", conditions=[cond]), local=local))
    assert "conditions" not in _status_of(shown)
    # next to a ClassMissing condition cleared in the same write, both are kept
    missing = {
        "type": CLASS_MISSING,
        "status": "True",
        "reason": "NotFound",
        "message": "m",
        "lastTransitionTime": k8s_time(NOW - timedelta(hours=1)),
    }
    both = _status_of(
        next_steps(observe(record(phase="Scheduled", conditions=[missing]), local=local))
    )
    types = {c["type"]: c["status"] for c in both["conditions"]}
    assert types == {CLASS_MISSING: "False", IMAGE_VERIFIED: "True"}


def test_a_refused_signature_fails_the_vm_with_its_reason_and_condition() -> None:
    msg = "image reg/base@sha256:0 has no signature; required key sha256:f"
    refused = Verification(False, "ImageUnsigned", msg)
    local = LocalFacts(failure=("ImageUnsigned", msg), verification=refused)
    action = next_steps(observe(record(phase="Scheduled"), local=local))
    assert action.why is Why.START_FAILED
    assert not any(isinstance(s, Start | Stop) for s in action.steps)
    status = _status_of(action)
    assert (status["phase"], status["exitReason"]) == ("Failed", "ImageUnsigned")
    assert msg in status["message"]
    (cond,) = status["conditions"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "ImageUnsigned", msg)
    (event,) = [s for s in action.steps if isinstance(s, Emit)]
    assert event.reason == "ImageUnsigned" and event.warning
    assert isinstance(action.steps[-1], Cleanup)


def test_after_an_agent_restart_a_vm_the_runtime_reattached_carries_on() -> None:
    """Nothing of LocalFacts survives a restart: what the runtime reports decides. A VM it
    re-attached running is watched (no second Start, so no second JIT config); one that
    exited while no agent ran is reported with its exit code; only an unknown one is Lost."""
    fresh = LocalFacts()
    started = NOW - timedelta(minutes=5)
    running = next_steps(
        observe(record(phase="Running", started_at=started), "running", local=fresh)
    )
    assert (running.why, running.steps) == (Why.RUNNING, ())
    late = next_steps(observe(record(phase="Starting", started_at=started), "running", local=fresh))
    assert late.why is Why.REPORT_RUNNING and not any(isinstance(s, Start) for s in late.steps)
    # started, the report of it not yet written when the old agent died
    unreported = next_steps(observe(record(phase="Scheduled"), "running", local=fresh))
    assert unreported.why is Why.REPORT_STARTED
    assert not any(isinstance(s, Start | Prepare) for s in unreported.steps)
    for runtime, phase, code in (("exited-0", "Succeeded", 0), ("exited-3", "Failed", 3)):
        ended = next_steps(
            observe(record(phase="Running", started_at=started), runtime, local=fresh)
        )
        status = _status_of(ended)
        assert (ended.why, status["phase"], status["exitCode"]) == (Why.EXITED, phase, code)
        assert isinstance(ended.steps[-1], Cleanup)
    lost = next_steps(observe(record(phase="Running", started_at=started), "missing", local=fresh))
    assert lost.why is Why.LOST and _status_of(lost)["exitReason"] == "Lost"
