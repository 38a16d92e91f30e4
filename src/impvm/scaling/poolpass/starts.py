"""The per-pool backoff on start failures: one broken template must not spend the installation
for everyone. Pure.

A VM *failed at start* when it ended ``Failed`` before its runner was ever seen online and
without a job (its runner exited at once, its image could not be prepared, its start timed out);
a lost node, a lost runtime or a passed deadline is not the template's fault. After ``n`` such
VMs of the pool's current template in a row, the next VM is made ``base * 2**(n-1)`` seconds
after the last one ended, at most ``cap`` (``start_failure_backoff_seconds`` 5 and
``start_failure_backoff_cap_seconds`` 300: ARC backs a failing EphemeralRunner off 5, 10, 20,
40, 80 s). A runner of the current template that comes online or takes a job ends the streak;
so does a template edit (another template hash): a fixed template recovers at once.

Condition ``TemplateFailing`` (True while a streak lasts) names the template, the last VM and
its exit reason and code, and when the next VM is made; a Warning Event when it becomes True.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from impvm.api.conditions import ConditionSet
from impvm.api.models import VMPhase
from impvm.api.times import k8s_time
from impvm.api.vm import VM
from impvm.scaling.poolpass.acts import EventSpec
from impvm.scaling.poolpass.memory import StartFailures
from impvm.scaling.poolpass.world import PoolWorld

__all__ = ["CONDITION", "failed_at_start", "next_start", "start_condition", "start_failures"]

CONDITION = "TemplateFailing"
#: exit reasons that say nothing about the template
_NOT_THE_TEMPLATE = frozenset({"NodeLost", "Lost", "DeadlineExceeded"})


def failed_at_start(world: PoolWorld, vm: VM) -> bool:
    """``vm`` ended Failed before its runner was seen online and without a job (see the module
    docstring)."""
    return (
        vm.phase == VMPhase.FAILED
        and (vm.status.exit_reason or "") not in _NOT_THE_TEMPLATE
        and not vm.runner_seen
        and not vm.has_job
        and world.job_on(vm.name) is None
    )


def _started(world: PoolWorld, vm: VM) -> bool:
    """``vm``'s runner is, or was, up: listed online or busy, recorded so, or it ran a job."""
    listed = any(r.name == vm.name and (r.online or r.busy) for r in world.github.runners or ())
    return listed or vm.runner_seen or vm.has_job or world.job_on(vm.name) is not None


def start_failures(world: PoolWorld, digest: str, made_from: dict[str, str]) -> StartFailures:
    """The streak after this pass: the memory's (a fresh one for another template ``digest``)
    with this pass's start failures of VMs made from ``digest`` (``made_from``: each VM's
    template hash) counted once each, or ended by a runner of it that is up."""
    sf = world.memory.starts
    if sf.template_hash != digest:
        sf = StartFailures(template_hash=digest)
    ours = [vm for vm in world.vms if made_from.get(vm.name) == digest]
    names = {vm.name for vm in world.vms}
    counted = set(sf.counted & names)
    new = [vm for vm in ours if vm.name not in counted and failed_at_start(world, vm)]
    counted |= {vm.name for vm in new}
    if any(_started(world, vm) for vm in ours):
        return StartFailures(template_hash=digest, counted=frozenset(counted))
    out = replace(sf, counted=frozenset(counted))
    for vm in sorted(new, key=lambda v: (v.status.finished_at or world.now, v.name)):
        out = replace(
            out,
            count=out.count + 1,
            last_at=vm.status.finished_at or world.now,
            last_vm=vm.name,
            last_reason=vm.status.exit_reason or "Failed",
            last_code=vm.status.exit_code,
        )
    return out


def next_start(sf: StartFailures, world: PoolWorld) -> dt.datetime | None:
    """When the next VM may be made (None: no streak)."""
    if sf.count == 0 or sf.last_at is None:
        return None
    s = world.settings
    delay = min(
        s.start_failure_backoff_cap_seconds, s.start_failure_backoff_seconds * 2 ** (sf.count - 1)
    )
    return sf.last_at + dt.timedelta(seconds=delay)


def start_condition(
    world: PoolWorld, sf: StartFailures, conds: ConditionSet, events: list[EventSpec]
) -> None:
    """Set ``TemplateFailing`` from the streak (a Warning Event when it becomes True)."""
    template = world.pool.spec.template_name
    if sf.count == 0:
        text = f"no VM of template {template!r} failed at start since a runner of it came up"
        conds.set("TemplateFailing", False, "RunnersStart", text, world.now)
        return
    at = next_start(sf, world)
    when = "now" if at is None or at <= world.now else f"at {k8s_time(at)}"
    code = "" if sf.last_code is None else f", exit code {sf.last_code}"
    text = (
        f"{sf.count} VM(s) of template {template!r} in a row failed before their runner came "
        f"online; last: {sf.last_vm} ({sf.last_reason}{code}); the next VM is made {when}"
    )
    reason = sf.last_reason if sf.last_reason.isalnum() else "StartFailed"
    if conds.set(CONDITION, True, reason, text, world.now):
        events.append(EventSpec("TemplateFailing", text, warning=True))
