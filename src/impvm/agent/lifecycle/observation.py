"""What :func:`~impvm.agent.lifecycle.next_steps` sees of one VM: the observation (the VM, its
size, what the runtime reports, the node's capacity), what this agent did for it
(:class:`LocalFacts`), whether the host can run VMs (:class:`Preflight`) and the agent's settings
(:class:`Policy`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from impvm.agent.capacity import Resources
from impvm.agent.runtime import RuntimeState, Verification
from impvm.api.models import VMPhase
from impvm.api.vm import VM

#: Phases of a VM the runtime has not been asked to start.
NOT_STARTED: frozenset[VMPhase | None] = frozenset({None, VMPhase.PENDING, VMPhase.SCHEDULED})


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
