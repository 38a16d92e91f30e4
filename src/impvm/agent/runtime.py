"""The ``Runtime`` protocol: how the node agent prepares, starts, inspects, stops and cleans up one
VM. Implementations: ``process`` (bubblewrap sandbox, :mod:`impvm.agent.process`) and ``qemu``
(microVM, a later issue).

A runtime is handed the JIT config only in :meth:`Runtime.start` and passes it to the guest at
launch and nowhere else (the runner image contract: the configuration is passed directly to the
guest runner at launch time, never placed in the VM manifest, the base image, or logs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from impvm.agent.network.policy import EgressLayer


class VMRuntimeError(Exception):
    """A runtime could not do what was asked. The message never contains the JIT config."""


class ImageError(VMRuntimeError):
    """An image could not be pulled, verified or unpacked (bad reference, digest mismatch, ...).
    ``reason``: the VM's exit reason it gives (subclasses name their own)."""

    reason = "ImagePullFailed"


@dataclass(frozen=True, repr=False)
class Secret:
    """A secret value whose ``repr``/``str`` never shows it."""

    value: str = field(repr=False)

    def reveal(self) -> str:
        """The secret value; only call where it is handed to the guest."""
        return self.value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__


@dataclass(frozen=True)
class VMRequest:
    """Everything a runtime needs to run one VM.

    ``vm_id`` is stable and unique per ImpVM (``<namespace>.<name>.<uid prefix>``); the runtime
    keeps all per-VM state under ``workdir`` (private to this VM, mode 0700, removed by
    :meth:`Runtime.cleanup`). Sizes: ``memory_mib`` in MiB, ``disk_gib`` in GiB. ``egress``: the
    egress policy layers of its network (:mod:`impvm.agent.network.policy`; empty: the default
    public layer), enforced where the runtime has a node network.
    ``verify_public_key``: PEM public key whose sigstore signatures the image and runner layer
    must carry (``ImpVM.spec.verify.publicKey``); None: no signature requirement.
    """

    vm_id: str
    name: str
    namespace: str
    image: str
    runner_layer: str | None
    allow_unpinned_images: bool
    vcpu: int
    memory_mib: int
    disk_gib: int
    workdir: Path
    egress: tuple[EgressLayer, ...] = ()
    verify_public_key: str | None = None


RuntimeStatus = Literal["starting", "running", "exited", "missing"]


@dataclass(frozen=True)
class Verification:
    """The signature check of a VM's image and runner layer, as its ``ImageVerified`` condition
    reports it (:mod:`impvm.agent.signing`): ``verified`` (the condition's status), ``reason``
    (``Verified`` or why it was refused) and ``message`` (naming the image and the key)."""

    verified: bool
    reason: str
    message: str


@dataclass(frozen=True)
class RuntimeState:
    """What a runtime observes of one VM.

    ``status``: starting (launched, runner not yet started), running (the runner process runs),
    exited (``exit_code`` set; -1 when killed), missing (the runtime knows nothing of it, e.g.
    after an agent restart that could not re-attach). ``log_tail``: last console lines, already
    scrubbed of the JIT config.
    """

    status: RuntimeStatus
    exit_code: int | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    log_tail: str = ""

    @property
    def active(self) -> bool:
        """The VM still runs (launched and not yet exited): it must be stopped before cleanup."""
        return self.status in ("starting", "running")


@runtime_checkable
class Runtime(Protocol):
    """A way to run VMs on this node. Every method is async and must not block the event loop."""

    #: ``process`` or ``qemu``.
    name: str

    async def prepare(self, req: VMRequest) -> None:
        """Make the image (+ runner layer) ready: pull by digest, verify, unpack (cached and
        shared read-only between VMs). Raises :class:`ImageError`."""
        ...

    async def start(self, req: VMRequest, jitconfig: Secret) -> None:
        """Launch the VM; its ``/usr/local/bin/runner`` gets ``IMP_GITHUB_JITCONFIG`` from
        ``jitconfig`` and nothing else ever sees it. Raises :class:`VMRuntimeError`."""
        ...

    async def inspect(self, req: VMRequest) -> RuntimeState:
        """Observe the VM (never raises for a VM that is simply gone: status ``missing``)."""
        ...

    async def stop(self, req: VMRequest, grace_seconds: float = 10.0) -> None:
        """Stop the VM: graceful first, killed after ``grace_seconds``. Idempotent."""
        ...

    async def cleanup(self, req: VMRequest) -> None:
        """Remove every per-VM file (scratch, logs, the delivered JIT config). Idempotent."""
        ...

    async def keep_console(self, req: VMRequest, dest: Path) -> bool:
        """Copy the VM's console (bounded, its JIT config scrubbed) to ``dest``; False when it
        has none."""
        ...
