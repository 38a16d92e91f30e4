"""What :func:`~impvm.agent.lifecycle.next_steps` decides for one VM: the steps the agent shell
carries out in order (:data:`Step`), which rung decided (:class:`Why`), and the decision
(:class:`VMSteps`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


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
