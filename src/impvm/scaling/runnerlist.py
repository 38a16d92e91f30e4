"""How old a list of GitHub's runner registrations a pool pass may decide from, and whether a
shared list is fresh enough for it. Pure: no I/O, no clock.

A pool's registrations are read from one list per installation and scope, shared by every pool
of it (:mod:`impvm.operator.runners`). Reading it on every pass of every pool is what made an
idle fleet call GitHub hundreds of times a minute; the rules here say when an older list is as
good as a new one:

* a pool with a VM bound to a node whose runner GitHub has not yet reported online or busy,
  and that is younger
  than ``runner_wait_fresh_seconds``, accepts a list at most ``awaiting_runner_list_seconds``
  old (concurrent passes of the installation's pools share it; otherwise each pass reads a new
  one, as every pass did before the lists were shared): the runner comes online any moment,
  may take a job and finish it within seconds, and the pool must see it up once to count its
  time to ready (warm pool);
* any other pool (runners idle or busy, jobs and VM phases arrive through webhooks and the VM
  watch) accepts a list up to ``idle_runner_list_seconds`` old: an idle installation makes at
  most one list call that often (GitHub REST "Best practices": avoid polling, use conditional
  requests);
* never a list whose request started before the pool's last change of its own registrations
  (a JIT config minted, a runner deleted): that list may lack the new registration, and a
  running VM whose registration is missing is replaced (:mod:`impvm.scaling.poolpass.sizing`).

Together with the VM cache holding every VM this operator created from the moment its create
returned (:mod:`impvm.operator.sources`), a list used this way never holds a registration whose
VM the pass does not see (so none is taken for an orphan), and never lacks one the pool made
after it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from impvm.api.models import VMPhase
from impvm.api.vm import VM
from impvm.scaling.settings import PassSettings


def awaits_runner(vm: VM) -> bool:
    """The VM is bound to a node (or in a phase past ``Pending``), it is alive, and its recorded
    runner was never seen online or busy (a job recorded from a webhook does not count:
    GitHub's list must still show the runner up once). A VM bound to no node cannot bring a
    runner online; its binding changes the VM, which wakes the pool."""
    s = vm.status
    if vm.deleting or vm.is_terminal:
        return False
    if not vm.spec.node_name and s.phase in (None, VMPhase.PENDING):
        return False
    return not (s.runner is not None and (s.runner.online or s.runner.busy))


def fresh_wait(vms: Iterable[VM], now: dt.datetime, settings: PassSettings) -> bool:
    """A VM awaits its runner and started (or was created) less than
    ``runner_wait_fresh_seconds`` ago."""
    for vm in vms:
        if not awaits_runner(vm):
            continue
        since = vm.status.started_at or vm.created_at
        if (now - since).total_seconds() < settings.runner_wait_fresh_seconds:
            return True
    return False


def max_list_age(vms: Iterable[VM], now: dt.datetime, settings: PassSettings) -> float:
    """Seconds: the oldest runner list this pass may use (see the module docstring)."""
    if fresh_wait(vms, now, settings):
        return settings.awaiting_runner_list_seconds
    return settings.idle_runner_list_seconds


@dataclass(frozen=True, slots=True)
class Listing:
    """When a runner list's request started (monotonic seconds)."""

    started: float

    def usable(self, mono: float, max_age: float, changed_at: float | None) -> bool:
        """Whether a pass at ``mono`` that accepts ``max_age`` seconds, and whose pool last
        changed its registrations at ``changed_at`` (None: never), may use this list."""
        if changed_at is not None and self.started <= changed_at:
            return False
        return mono - self.started <= max_age
