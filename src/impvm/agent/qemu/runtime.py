"""The ``qemu`` runtime itself (:mod:`impvm.agent.qemu`): :class:`QemuRuntime`, its disks - the
image's read-only ext4 disk kept in the image's cache entry, the VM's scratch disk - and the
launch of one VM, on :class:`~impvm.agent.runtime_base.RuntimeBase`'s bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from impvm.agent.guest_io import StatusLog, config_message
from impvm.agent.images import EvictedError, ImageStore, PreparedImage
from impvm.agent.network.node import GuestNetwork, NodeNetwork
from impvm.agent.qemu.channels import (
    _QemuVM,
    ask_to_stop,
    exit_code,
    guest_config,
    hand_over_config,
    runner_started,
)
from impvm.agent.qemu.cmdline import qemu_args
from impvm.agent.qemu.files import _DISK, _SCRATCH, _STATUS, _control_path, _Held, open_files
from impvm.agent.qemu.record import _write_record, adopt, kill_recorded, launch_record
from impvm.agent.qemu.sandbox import (
    QEMU_UIDS,
    launch,
    scope_prefix,
    systemd_scope_available,
    user_words,
)
from impvm.agent.qemu_accel import AccelChoice
from impvm.agent.qemu_guest import FAST_BOOT_ARGS, Kernel
from impvm.agent.runtime import ImageError, Secret, VMRequest, VMRuntimeError
from impvm.agent.runtime_base import CONSOLE_LOG, RuntimeBase
from impvm.agent.survivor import identity_of
from impvm.agent.tools import run_tool


async def _run(what: str, *args: str) -> None:
    await run_tool(what, *args, error=ImageError)


class QemuRuntime(RuntimeBase["_QemuVM"]):
    """:class:`impvm.agent.runtime.Runtime` booting each VM in QEMU (see :mod:`impvm.agent.qemu`).

    ``store``: the image cache (it also keeps the image disks); ``kernel``: the guest kernel
    (QEMU boots :attr:`Kernel.boot_image`); ``boot_args``: kernel arguments beyond console and
    panic (:data:`impvm.agent.qemu_guest.FAST_BOOT_ARGS`); ``initramfs``: the guest initramfs
    built for it
    (:func:`impvm.agent.qemu_guest.build_initramfs`); ``accel``: the probed accelerator and machine
    (:func:`impvm.agent.qemu_accel.detect_accelerator`); ``state_dir``: agent-owned directory of
    the runtime (guest assets); ``extra_ro_binds``: host paths shared read-only at the same path;
    ``auth_file``: registry auth for pulls; ``qemu``: the QEMU executable; ``tail_lines``: lines in
    :attr:`RuntimeState.log_tail`; ``network``: the node's guest networks (``None``: user-mode
    networking, no isolation); ``systemd_scope``: start each VM in a systemd scope of its own
    (None: when :func:`systemd_scope_available`); ``qemu_uids``: the uids QEMU processes run as,
    one per running VM (:data:`QEMU_UIDS`; ``None``, or an agent that is not root: the agent's
    own user).
    """

    name = "qemu"
    network_kind = "tap"

    def __init__(
        self,
        store: ImageStore,
        *,
        kernel: Kernel,
        initramfs: Path,
        accel: AccelChoice,
        state_dir: Path,
        extra_ro_binds: Sequence[Path] = (),
        auth_file: Path | None = None,
        qemu: str = "qemu-system-x86_64",
        tail_lines: int = 40,
        network: NodeNetwork | None = None,
        systemd_scope: bool | None = None,
        boot_args: Sequence[str] = FAST_BOOT_ARGS,
        qemu_uids: range | None = QEMU_UIDS,
    ) -> None:
        super().__init__(store, auth_file=auth_file, tail_lines=tail_lines, network=network)
        self.qemu_uids = qemu_uids if os.geteuid() == 0 else None
        self._uid_lock = asyncio.Lock()
        self.boot_args = tuple(boot_args)
        self.systemd_scope = systemd_scope_available() if systemd_scope is None else systemd_scope
        self.kernel = kernel
        self.initramfs = initramfs
        self.accel = accel
        self.state_dir = state_dir
        self.extra_ro_binds = [Path(p) for p in extra_ro_binds]
        self.qemu = qemu

    # ------------------------------------------------------------------ images

    async def _prepare(self, req: VMRequest) -> PreparedImage:
        """Pull/verify/unpack the image + runner layer through the store (cached), then build
        (or reuse) its read-only ext4 image disk. Raises :class:`ImageError`."""
        prepared = await super()._prepare(req)
        try:
            await self.image_disk(prepared)
        except EvictedError:  # by a concurrent prepare between the two steps: once more
            prepared = await super()._prepare(req)
            await self.image_disk(prepared)
        return prepared

    async def image_disk(self, prepared: PreparedImage) -> Path:
        """The read-only ext4 disk of ``prepared`` (in its cache entry, 0444), built once with
        ``mkfs.ext4 -d`` (size: 1.25 x the tree + 64 MiB, no journal) and published atomically.
        Raises :class:`ImageError` when mkfs fails or the entry was evicted."""
        size_mib = (prepared.size_bytes * 5 // 4) // (1 << 20) + 64

        async def build(tmp: Path) -> None:
            await _run(
                "building the image disk",
                "mkfs.ext4",
                "-q",
                "-F",
                "-O",
                "^has_journal",
                "-L",
                "imp-root",
                "-d",
                str(prepared.rootfs),
                str(tmp),
                f"{size_mib}M",
            )

        return await self.store.derived(prepared, _DISK, build)

    # ------------------------------------------------------------------ launch

    async def _launch(
        self, req: VMRequest, prepared: PreparedImage, jitconfig: Secret, net: GuestNetwork | None
    ) -> _QemuVM:
        """Boot the VM on ``net``'s tap device (user-mode networking without one) as a uid of
        its own inside QEMU's seccomp sandbox; the guest's ``/usr/local/bin/runner`` gets
        ``IMP_GITHUB_JITCONFIG`` through the config channel (:mod:`impvm.agent.guest_io`).
        Raises :class:`VMRuntimeError` when the config cannot be passed or QEMU cannot be
        started (messages never contain the JIT config)."""
        disk = await self.image_disk(prepared)
        try:
            message = config_message(
                guest_config(req, self.extra_ro_binds, net), jitconfig.reveal()
            )
        except ValueError as exc:
            raise VMRuntimeError(f"VM {req.vm_id}: {exc}") from None
        wd = req.workdir
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(wd, 0o700)
        for name in (CONSOLE_LOG, _STATUS):
            fd = os.open(wd / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            _control_path(wd).unlink()
        await _run(
            "creating the scratch disk",
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "imp-scratch",
            # no journal: the disk dies with the VM, so there is nothing to recover after a
            # crash, and the guest mounts it without starting a journal thread
            "-O",
            "^has_journal",
            "-E",
            "lazy_itable_init=1",
            str(wd / _SCRATCH),
            f"{max(req.disk_gib, 1)}G",
        )
        os.chmod(wd / _SCRATCH, 0o600)
        held = _Held()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        config_fd = held.socket(theirs)
        logfd = os.open(wd / CONSOLE_LOG, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            async with self._uid_lock:  # a uid is free until its QEMU runs
                files = open_files(
                    req,
                    self.kernel.boot_image,
                    self.initramfs,
                    self.extra_ro_binds,
                    disk,
                    net,
                    held,
                    config_fd,
                )
                args = [
                    *user_words(req.vm_id, self.qemu_uids, self.accel.accel),
                    *qemu_args(self.qemu, self.accel, self.boot_args, req, files),
                ]
                if self.systemd_scope:
                    args = [*scope_prefix(req.vm_id), *args]
                proc = launch(args, logfd, tuple(held.fds))
        except (OSError, VMRuntimeError) as exc:
            ours.close()
            raise VMRuntimeError(f"starting QEMU for VM {req.vm_id} failed: {exc}") from None
        finally:
            held.close()
            os.close(logfd)
        vm = _QemuVM(
            proc=proc,
            prepared=prepared,
            secret=jitconfig.reveal(),
            workdir=wd,
            status=StatusLog(wd / _STATUS),
        )
        vm.tasks.append(asyncio.create_task(hand_over_config(req.vm_id, ours, message)))
        ident = identity_of(proc.pid)
        if ident is not None:  # None: it ended already, the reaper reports it
            rec = launch_record(ident, prepared, vm)
            await asyncio.to_thread(_write_record, wd, rec)
        return vm

    # ------------------------------------------------------------------ the guest's word

    async def _adopt(self, req: VMRequest) -> _QemuVM | None:
        """Re-attach the VM an earlier agent process launched (:func:`.record.adopt`)."""
        return await adopt(self.store, req)

    async def _exit_code(self, vm: _QemuVM, returncode: int) -> int:
        """The exit code the guest reported on its status port (:func:`.channels.exit_code`)."""
        return await exit_code(vm)

    async def _runner_started(self, vm: _QemuVM) -> bool:
        """The guest reported ``runner-start`` (:func:`.channels.runner_started`)."""
        return await runner_started(vm)

    async def _ask_to_stop(self, vm: _QemuVM) -> None:
        """``stop`` on the control port (:func:`.channels.ask_to_stop`)."""
        await ask_to_stop(vm)

    def _remove_leftovers(self, workdir: Path) -> None:
        """Kill a QEMU left running by an earlier agent (by its launch record) and remove the
        control socket (which may live outside the workdir)."""
        kill_recorded(workdir)
        with contextlib.suppress(OSError, VMRuntimeError):
            _control_path(workdir).unlink(missing_ok=True)
