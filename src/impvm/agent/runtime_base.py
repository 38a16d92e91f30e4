"""The bookkeeping every :class:`~impvm.agent.runtime.Runtime` shares: which VMs run, their images,
waiting for their exit, the console tail, stop (graceful, then killed), cleanup, and each VM's own
network (with a :class:`~impvm.agent.network.node.NodeNetwork`: attached just before the launch,
detached just after the stop, so every path that cleans a VM up also removes its network).

A runtime subclasses :class:`RuntimeBase` and supplies only what is its own: how a VM is launched
(:meth:`RuntimeBase._launch`), what its exit code is (:meth:`RuntimeBase._exit_code`), whether
the runner has started (:meth:`RuntimeBase._runner_started`), how it is asked to stop
(:meth:`RuntimeBase._ask_to_stop`), what an earlier agent may have left
(:meth:`RuntimeBase._remove_leftovers`) and which interface its VMs get
(:attr:`RuntimeBase.network_kind`).

State lives in memory, and on disk where a runtime's VMs outlive the agent: such a runtime
records each launched VM in its workdir and supplies :meth:`RuntimeBase._adopt`, which a new
agent process's :meth:`RuntimeBase.inspect` calls for a VM it does not know; the VM is then
watched, stopped and cleaned up like one it launched itself (re-attached). A runtime whose VMs
die with the agent (the default) adopts nothing: after an agent restart ``inspect`` reports
``missing`` and :meth:`RuntimeBase.cleanup` removes what is left on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from impvm.agent.guesttext import printable
from impvm.agent.images import ImageStore, PreparedImage
from impvm.agent.images.tree import _remove_tree
from impvm.agent.network.node import GuestNetwork, NodeNetwork
from impvm.agent.network.plan import Kind
from impvm.agent.runtime import RuntimeState, Secret, VMRequest, VMRuntimeError
from impvm.agent.survivor import SecretPrint

log = logging.getLogger("impvm.agent.runtime")

#: The VM's console (stdout/stderr or serial port) in its workdir, mode 0600.
CONSOLE_LOG = "console.log"
#: How much of the console's end :meth:`RuntimeBase.inspect` reads (bytes).
TAIL_BYTES = 16384


#: A kept console (of a failed VM) holds at most this many bytes: its first
#: :data:`KEPT_HEAD_BYTES` (the boot) and its end, cut at line boundaries.
KEPT_BYTES = 1024 * 1024
KEPT_HEAD_BYTES = 64 * 1024
#: Kept consoles per node; the oldest go first.
KEPT_FILES = 100


#: A running VM's console is compacted to its first :data:`KEPT_HEAD_BYTES` and last
#: :data:`LIVE_TAIL_BYTES` once it passes :data:`LIVE_MAX_BYTES` (a chatty job cannot fill the
#: node's disk). Writers append (``O_APPEND``: bwrap's stdout, QEMU's ``append=on``), so their
#: next write lands after the compacted text.
LIVE_MAX_BYTES = 8 * 1024 * 1024
LIVE_TAIL_BYTES = 2 * 1024 * 1024


def compact_console(path: Path, limit: int = LIVE_MAX_BYTES, tail: int = LIVE_TAIL_BYTES) -> bool:
    """Shrink console ``path`` in place to its head and last ``tail`` bytes (cut at lines, a
    marker between) when it is over ``limit`` bytes (blocking). Bytes written while it runs may
    be lost; the marker says how much was cut. True when it compacted."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    with os.fdopen(fd, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= limit:
            return False
        first = f.read(KEPT_HEAD_BYTES)
        first = first[: first.rfind(b"\n") + 1] or first
        f.seek(size - tail)
        last = f.read()
        last = last[last.find(b"\n") + 1 :] or last
        cut = size - len(first) - len(last)
        f.seek(0)
        f.truncate(0)
        f.write(first + f"[... {cut} bytes cut ...]\n".encode() + last)
    return True


def keep_console(
    source: Path,
    dest: Path,
    secret: str | None,
    limit: int = KEPT_BYTES,
    head: int = KEPT_HEAD_BYTES,
    keep_files: int = KEPT_FILES,
) -> bool:
    """Copy console ``source`` to ``dest`` (mode 0600; blocking): at most ``limit`` bytes, the
    middle of a longer one replaced by a line saying how much was cut, every occurrence of
    ``secret`` (the VM's JIT config) replaced by ``***``. Then remove the oldest ``*.log`` in
    ``dest``'s directory beyond ``keep_files``. False when ``source`` does not exist."""
    try:
        with source.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= limit:
                data = f.read()
            else:
                first = f.read(head)
                first = first[: first.rfind(b"\n") + 1] or first
                f.seek(size - (limit - head))
                last = f.read()
                last = last[last.find(b"\n") + 1 :] or last
                cut = size - len(first) - len(last)
                data = first + f"[... {cut} bytes cut ...]\n".encode() + last
    except FileNotFoundError:
        return False
    if secret:
        data = data.replace(secret.encode(), b"***")
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = dest.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, dest)
    kept = sorted(dest.parent.glob("*.log"), key=lambda p: (p.stat().st_mtime, p.name))
    for old in kept[: max(0, len(kept) - keep_files)]:
        old.unlink(missing_ok=True)
    return True


def guest_hostname(req: VMRequest) -> str:
    """The VM's host name: its name as a DNS label (lower case, ``[a-z0-9-]``, at most 63)."""
    return re.sub(r"[^a-z0-9-]", "-", req.name.lower())[:63].strip("-") or "impvm"


def remove_workdir(workdir: Path) -> None:
    """Remove a VM's workdir completely, read-only parts included (blocking; run in a thread)."""
    if os.path.lexists(workdir):
        _remove_tree(workdir)
    if os.path.lexists(workdir):
        shutil.rmtree(workdir)


class VMProcess(Protocol):
    """What the runtimes use of a VM's process: an :class:`asyncio.subprocess.Process` it
    launched, or an :class:`~impvm.agent.survivor.AdoptedProcess` an earlier agent launched."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class LaunchedVM:
    """One VM a runtime launched (or re-attached): its process (bwrap or QEMU), image, JIT
    config (kept only to scrub it from the console tail; empty for a re-attached VM, whose
    config was consumed at boot, which is scrubbed by ``secret_print`` instead), and what is
    known of its end (``exit_code`` -1: killed)."""

    proc: VMProcess
    prepared: PreparedImage
    secret: str
    workdir: Path
    secret_print: SecretPrint | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    killed: bool = False
    finished_at: datetime | None = None
    exit_code: int | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


VM = TypeVar("VM", bound=LaunchedVM)


class RuntimeBase(Generic[VM]):
    """What both runtimes do the same way (see the module docstring).

    ``store``: the image cache; ``auth_file``: registry auth (docker-config style) for pulls;
    ``tail_lines``: lines returned in :attr:`RuntimeState.log_tail`; ``network``: the node's
    guest networks (``None``: no network of its own, development only).
    """

    #: ``process`` or ``qemu`` (the Runtime protocol).
    name: str
    #: The interface a node network gives this runtime's VMs: ``tap`` (QEMU) or ``netns`` (a
    #: namespace with a veth pair).
    network_kind: Kind

    def __init__(
        self,
        store: ImageStore,
        *,
        auth_file: Path | None,
        tail_lines: int,
        network: NodeNetwork | None = None,
    ) -> None:
        self.store = store
        self.network = network
        self.auth_file = auth_file
        self.tail_lines = tail_lines
        self._prepared: dict[str, PreparedImage] = {}
        self._vms: dict[str, VM] = {}

    # ------------------------------------------------------------------ what a runtime supplies

    async def _launch(
        self, req: VMRequest, prepared: PreparedImage, jitconfig: Secret, net: GuestNetwork | None
    ) -> VM:
        """Launch the VM's process, connected to ``net`` (its own network; ``None``: none);
        raise :class:`VMRuntimeError` (never showing the JIT config) when it cannot be
        launched."""
        raise NotImplementedError

    async def _exit_code(self, vm: VM, returncode: int) -> int:
        """The runner's exit status once the VM's process ended with ``returncode``."""
        raise NotImplementedError

    async def _runner_started(self, vm: VM) -> bool:
        """Whether the runner inside the (still running) VM has started."""
        raise NotImplementedError

    async def _ask_to_stop(self, vm: VM) -> None:
        """Ask the VM to end gracefully (its runner gets SIGTERM)."""
        raise NotImplementedError

    def _kill(self, vm: VM) -> None:
        """Kill the VM at once (after the grace period)."""
        with contextlib.suppress(ProcessLookupError):
            vm.proc.kill()

    async def _adopt(self, req: VMRequest) -> VM | None:
        """The VM ``req`` an earlier agent process launched and this one does not know, when it
        outlived that agent (running, or ended leaving its report); None: nothing to re-attach
        (the default: the runtime's VMs die with the agent)."""
        return None

    def _remove_leftovers(self, workdir: Path) -> None:
        """Remove what an earlier agent run may have left for this VM besides its workdir
        (blocking; run in a thread)."""

    async def _prepare(self, req: VMRequest) -> PreparedImage:
        """Pull/verify/unpack the image and runner layer through the store (cached); with
        ``req.verify_public_key`` both must be signed by that key (raises
        :class:`~impvm.agent.signing.SignatureError`)."""
        return await self.store.prepare(
            req.image,
            req.runner_layer,
            allow_unpinned=req.allow_unpinned_images,
            auth_file=self.auth_file,
            public_key=req.verify_public_key,
        )

    # ------------------------------------------------------------------ the Runtime protocol

    async def prepare(self, req: VMRequest) -> None:
        """Make the image (+ runner layer) ready for ``req``. Raises
        :class:`~impvm.agent.runtime.ImageError`."""
        self._prepared[req.vm_id] = await self._prepare(req)

    async def start(self, req: VMRequest, jitconfig: Secret) -> None:
        """Launch the VM (preparing its image first when :meth:`prepare` was not called). Raises
        :class:`VMRuntimeError` when the VM already runs or cannot be launched (the message never
        contains the JIT config)."""
        running = self._vms.get(req.vm_id)
        if running is not None and running.exit_code is None:
            raise VMRuntimeError(f"VM {req.vm_id} is already running")
        prepared = self._prepared.get(req.vm_id)
        if prepared is None or not prepared.rootfs.is_dir():
            await self.prepare(req)
            prepared = self._prepared[req.vm_id]
        self.store.retain(prepared.key)
        try:
            net = None
            if self.network is not None:  # its rules exist before its interface does
                net = await self.network.attach_vm(req, self.network_kind)
            vm = await self._launch(req, prepared, jitconfig, net)
        except BaseException:
            self.store.release(prepared.key)
            raise
        self._vms[req.vm_id] = vm
        vm.tasks.append(asyncio.create_task(self._reap(vm)))

    async def _reap(self, vm: VM) -> None:
        """Wait for the VM's process to end, then record the runner's exit code and the time."""
        rc = await vm.proc.wait()
        vm.exit_code = await self._exit_code(vm, rc)
        vm.finished_at = datetime.now(UTC)

    def _tail(self, vm: VM) -> str:
        """The last ``tail_lines`` console lines (blocking) without terminal control sequences
        (:func:`impvm.agent.guesttext.printable`), the JIT config replaced by ``***`` (defence in
        depth: the wrapper never prints it, but a guest program might); the console is first
        kept within :data:`LIVE_MAX_BYTES` (:func:`compact_console`)."""
        try:
            compact_console(vm.workdir / CONSOLE_LOG)
        except OSError:
            pass
        try:
            with (vm.workdir / CONSOLE_LOG).open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - TAIL_BYTES))
                data = f.read()
        except OSError:
            return ""
        text = printable(data)  # it goes into the VM's status and Events
        out = "\n".join(text.splitlines()[-self.tail_lines :])
        if vm.secret:
            return out.replace(vm.secret, "***")
        return vm.secret_print.scrub(out) if vm.secret_print else out

    async def inspect(self, req: VMRequest) -> RuntimeState:
        """``starting`` (launched, the runner has not started), ``running``, ``exited``
        (``exit_code``: the runner's exit status; -1 when killed) or ``missing`` (unknown to this
        runtime instance and not re-attachable, see :meth:`_adopt`). ``log_tail``: the
        console's last lines, JIT config scrubbed."""
        vm = self._vms.get(req.vm_id)
        if vm is None:
            vm = await self._adopt(req)
            if vm is None:
                return RuntimeState(status="missing")
            self._vms[req.vm_id] = vm
            ended = "ended meanwhile" if vm.exit_code is not None else "running"
            log.info("re-attached VM %s an earlier agent process launched (%s)", req.vm_id, ended)
            self.store.retain(vm.prepared.key)
            if vm.exit_code is None:
                vm.tasks.append(asyncio.create_task(self._reap(vm)))
        exited = vm.exit_code is not None  # before reading: an exited VM's log is complete
        tail = await asyncio.to_thread(self._tail, vm)
        if exited:
            return RuntimeState(
                status="exited",
                exit_code=vm.exit_code,
                started_at=vm.started_at,
                finished_at=vm.finished_at,
                log_tail=tail,
            )
        started = await self._runner_started(vm)
        return RuntimeState(
            status="running" if started else "starting", started_at=vm.started_at, log_tail=tail
        )

    async def keep_console(self, req: VMRequest, dest: Path) -> bool:
        """Keep the VM's console at ``dest`` (:func:`keep_console`), before :meth:`cleanup`
        removes the workdir. False when there is no console."""
        vm = self._vms.get(req.vm_id)
        secret = vm.secret if vm is not None else None
        return await asyncio.to_thread(keep_console, req.workdir / CONSOLE_LOG, dest, secret)

    async def stop(self, req: VMRequest, grace_seconds: float = 10.0) -> None:
        """Stop the VM: ask it to end, then kill it once ``grace_seconds`` passed (at once when
        0). Returns when it has ended. Idempotent."""
        vm = self._vms.get(req.vm_id)
        if vm is None or vm.proc.returncode is not None:
            if vm is not None:
                await asyncio.gather(*vm.tasks, return_exceptions=True)
            return
        if grace_seconds > 0:
            deadline = time.monotonic() + grace_seconds
            await self._ask_to_stop(vm)
            with contextlib.suppress(TimeoutError):
                left = max(deadline - time.monotonic(), 0.1)
                await asyncio.wait_for(asyncio.shield(vm.proc.wait()), left)
        if vm.proc.returncode is None:
            vm.killed = True
            self._kill(vm)
        await asyncio.gather(*vm.tasks, return_exceptions=True)

    async def cleanup(self, req: VMRequest) -> None:
        """Stop the VM if needed (no grace), release its image, remove what an earlier agent
        left, its network and ``req.workdir`` (scratch, console), and forget the VM and its JIT
        config. Idempotent. Raises :class:`~impvm.agent.network.node.NetworkError` when its
        network cannot be removed (the workdir is kept, so a retry finds the VM again)."""
        await self.stop(req, grace_seconds=0)
        vm = self._vms.pop(req.vm_id, None)
        if vm is not None:
            self.store.release(vm.prepared.key)
        self._prepared.pop(req.vm_id, None)
        await asyncio.to_thread(self._remove_leftovers, req.workdir)
        if self.network is not None:  # before the workdir: its record points there
            await self.network.detach(req.vm_id)
        await asyncio.to_thread(remove_workdir, req.workdir)

    def known(self) -> set[str]:
        """Ids of the VMs this instance holds state for (launched or prepared, not cleaned up)."""
        return set(self._vms) | set(self._prepared)
