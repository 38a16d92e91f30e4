"""What a scaling policy sees and returns in the simulator (shared by the engine and policies).

The simulated pool's VMs are :class:`impvm.api.vm.VM`, the read model every component of impvm
reads: the agent's phase (``Starting`` until the runner is online, ``Running``, ``Succeeded``
once its job finished), the runner and job the operator recorded on it (``status.runner``,
``status.job``), and the job a policy made it for (annotation :data:`TRIGGER_ANNOTATION`;
GARM labels runners so). Times are seconds since the start of the simulation unless a field
says datetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from impvm.api.models import ImpVMClassSpec, ImpVMTemplateSpec, VMPhase
from impvm.api.vm import VM, template_hash
from impvm.scaling.names import runner_prefix

__all__ = [
    "CLASS",
    "POOL",
    "POOL_UID",
    "PREFIX",
    "TEMPLATE",
    "TEMPLATE_HASH",
    "TRIGGER_ANNOTATION",
    "Actions",
    "Policy",
    "PoolView",
    "busy",
    "idle",
    "starting",
    "trigger_job",
]

#: the simulated pool: its name, uid, and the prefix of its VMs' (and runners') names
POOL = "sim"
POOL_UID = "00000000-0000-0000-0000-000000000000"
PREFIX = runner_prefix(POOL, POOL_UID)
#: the job a policy created a VM for (GARM)
TRIGGER_ANNOTATION = "sim.imp.dev/trigger-job"
#: what the simulated pool's VMs are made of: one class and one template, and its hash (every
#: VM carries it, as the operator's do)
CLASS = ("sim", ImpVMClassSpec(vcpu=2, memory_mib=2048, disk_gib=10))
TEMPLATE = ImpVMTemplateSpec.model_validate(
    {"classRef": {"name": CLASS[0]}, "image": "sim.invalid/runner@sha256:" + "0" * 64}
)
TEMPLATE_HASH = template_hash(
    image=TEMPLATE.image,
    runner_layer=None,
    class_name=CLASS[0],
    vcpu=CLASS[1].vcpu,
    memory_mib=CLASS[1].memory_mib,
    disk_gib=CLASS[1].disk_gib,
    expire_after=None,
    allow_unpinned=False,
)


def busy(vm: VM) -> bool:
    """Its runner runs a job (GitHub reports it busy: the job is in progress)."""
    return not vm.is_terminal and vm.status.job is not None


def idle(vm: VM) -> bool:
    """Online, not running a job, not finished. A runner a job is being assigned to still looks
    idle to every observer: GitHub reports it busy only once the job is in progress."""
    return vm.phase == VMPhase.RUNNING and vm.status.job is None


def starting(vm: VM) -> bool:
    """Created, its runner not yet online."""
    return vm.phase == VMPhase.STARTING


def trigger_job(vm: VM) -> int | None:
    """The trace index of the job the policy made ``vm`` for, if any."""
    raw = vm.annotations.get(TRIGGER_ANNOTATION)
    return int(raw) if raw is not None else None


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolView:
    """One controller pass's view of the pool and its demand.

    - ``now`` (seconds) / ``clock`` (aware datetime): the pass's clock.
    - ``vms``: every VM of the pool, oldest first (finished ones until a policy deletes them);
      ``created``: each VM's creation (seconds), by name.
    - ``queued``: the pool's jobs queued on GitHub (not yet in progress), including those being
      assigned to an idle runner; ``queued_jobs``: ``(trace index, queued seconds)`` of each,
      oldest first.
    - Since the previous pass: ``arrivals`` (queued times), ``ready`` (``(time, seconds from
      creation)`` of runners that came online), ``started`` (``(job, VM name)``) and
      ``completed`` (count).
    """

    now: float
    clock: datetime
    vms: tuple[VM, ...]
    queued: int
    queued_jobs: tuple[tuple[int, float], ...] = ()
    arrivals: tuple[float, ...] = ()
    ready: tuple[tuple[float, float], ...] = ()
    started: tuple[tuple[int, str], ...] = ()
    completed: int = 0


@dataclass(frozen=True, slots=True)
class Actions:
    """What a pass does: create ``create`` VMs (the i-th made for job ``triggers[i]`` when
    given), delete the VMs named in ``delete``, and record ``records`` on VMs (the operator's
    status patches: ``(name, wire status)``). Deleting a busy VM is an error; deleting a
    runner a job is being assigned to sends the job back to the queue (GitHub re-queues it)."""

    create: int = 0
    delete: tuple[str, ...] = ()
    triggers: tuple[int | None, ...] = ()
    records: tuple[tuple[str, dict[str, object]], ...] = ()


class Policy(Protocol):
    """A scaling policy under test: fresh per run (it may keep state between passes)."""

    #: short key (``fixed``, ``adaptive``, ``arc``, ``garm``, ``imp``)
    name: str
    #: the key with its parameters, for the table
    label: str
    #: seconds between the passes the policy runs without any event (its resync or loop)
    tick_seconds: float
    #: ``resync``: a pass ``tick_seconds`` after the previous one when nothing woke it;
    #: ``loop``: passes on a fixed grid as well, whatever else happens
    tick_mode: str

    def plan(self, view: PoolView) -> Actions:
        """Decide one pass."""
        ...
