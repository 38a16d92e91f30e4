"""The ``qemu`` runtime: each VM is a QEMU (``qemu-system-x86_64``, Debian ``qemu-system-x86``)
virtual machine booting a kernel configured on the agent - its PVH image when it has one - with
the guest initramfs and the boot's kernel arguments (:mod:`impvm.agent.qemu_guest`,
:class:`~impvm.agent.qemu_guest.GuestBoot`), on the accelerator/machine chosen at agent start by a
real probe boot (:mod:`impvm.agent.qemu_accel`: KVM when it really boots, else TCG; ``microvm``,
else ``q35``).

Disks (a VM never writes to the shared image):

* image disk (serial ``imp-root``): one ext4 file per prepared image (``mkfs.ext4 -d`` from
  :attr:`PreparedImage.rootfs`, mode 0444), kept in the image's cache entry
  (:meth:`ImageStore.derived`) so the cache's size cap counts it and eviction removes it, attached
  ``readonly=on`` to every VM of that image - QEMU refuses writes, whatever the guest does;
* scratch disk (serial ``imp-scratch``): a per-VM sparse ext4 file (no journal) of ``disk_gib``
  GiB in the VM's workdir, the upper layer of the guest's overlayfs root; deleted by
  :meth:`cleanup`. So a file one VM writes is seen by no other VM and no later VM.

Host shares (``extra_ro_binds``, development only): 9p exports with ``readonly=on`` mounted at the
same path in the guest (a host symlink is reproduced as a symlink), like the process runtime's
binds; the development stack uses them to run the host's Python inside the busybox test image.

Privileges: the agent opens every file, socket and device a VM needs - the kernel and
initramfs (handed over as ``/proc/self/fd/N``), the image and scratch disks, console and status
files (``-add-fd`` fd sets), the control socket, the config channel, the tap device and shared
directories - and QEMU starts as a uid and gid of its own (:data:`QEMU_UIDS`, one no other
process has, so one VM's QEMU cannot signal, trace or read another's; through ``setpriv``: no
supplementary group but ``/dev/kvm``'s under KVM, no capability, no new privileges) inside its
seccomp sandbox (:data:`SANDBOX`: obsolete system calls, set*id, fork/exec and resource control
refused). QEMU 7.2 installs the sandbox before ``-runas`` would drop root, so ``-runas`` with
``elevateprivileges=deny`` dies of SIGSYS: QEMU is started unprivileged instead. An agent that
is not root runs QEMU as its own user.

JIT config (the runner image contract): delivered once over the config channel, a
virtio-serial port whose host side is one end of a socket pair only the agent holds
(:mod:`impvm.agent.guest_io`), with the non-secret per-VM config (host name, VM id, network,
shares); the guest init reads it, answers, closes the port, and the agent then closes its end,
so nothing in the running VM can read it again. It is never in a file, never on a command line,
never in a log, and not in fw_cfg (which still answers on its I/O ports: it holds only the
kernel, initramfs and command line); the init hands it to ``/usr/local/bin/runner`` as
``IMP_GITHUB_JITCONFIG`` only.

Console and status: ttyS0 (kernel + init + runner output) → ``<workdir>/console.log`` (0600;
:meth:`inspect` returns its tail with the JIT config replaced by ``***``). ttyS1 →
``<workdir>/status.log``: ``IMPVM-STATUS runner-start`` then ``IMPVM-STATUS exit <code>``, written
by the guest init, read as it grows and kept small (:class:`~impvm.agent.guest_io.StatusLog`):
they give ``running`` and the exit code, both as the guest reported them.
ttyS2 ← the unix socket ``<workdir>/control.sock``: :meth:`stop` writes ``stop`` there, the init
sends SIGTERM to every guest process and powers off when the runner ended.

Network: with a node network (:class:`impvm.agent.network.node.NodeNetwork`, the default of
``impvm agent``) each VM gets its own tap device (``-netdev tap``), NAT to the node's uplink and
its egress policy; the guest's address, gateway and resolvers arrive on the config channel
(``net`` and ``dns`` lines). Without one (``--guest-network unisolated``, development only) QEMU
user-mode networking (slirp): guest 10.0.2.15/24, gateway 10.0.2.2 = the host's loopback, DNS
10.0.2.3 - no isolation at all, the guest reaches every host loopback service.

Lifetime: a VM outlives the agent process, so a job survives an agent crash or upgrade. QEMU runs
in a session of its own (``setsid``: no signal to the agent's process group reaches it) and
nothing ties it to its parent (no parent-death signal; started with ``subprocess.Popen`` and
watched through a pidfd, :meth:`~impvm.agent.survivor.AdoptedProcess.launch`, because an asyncio
subprocess is killed when the agent's event loop closes on a graceful exit); under systemd
(``/run/systemd/system``, root) it is started through
``systemd-run --scope`` in ``impvm-vms.slice``, a cgroup of its own, so stopping or restarting the
agent's unit leaves it alone. Everything a new agent process needs is in the VM's private workdir:
the console and status files, the control socket, and ``qemu.json`` (written at launch: QEMU's
:class:`~impvm.agent.survivor.ProcessIdentity` - pid, boot id, start time, so a reused pid is
never taken for the VM - its image's cache key and its start time). The config channel was
used up at boot and is never needed again. A new agent's :meth:`inspect` of a VM it does not
know re-attaches it (:meth:`_adopt`): a running QEMU is watched through a pidfd and stopped through
its control socket as before; one that ended while no agent ran is reported with the exit code
its guest wrote to the status port (-1 when there is none). ``cleanup`` kills a QEMU still
running (by its identity) and removes everything. Start, wait, tail, stop, cleanup and the network
attach/detach are :class:`~impvm.agent.runtime_base.RuntimeBase`'s; this module supplies the VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from impvm.agent.guest_io import CONFIG_PORT, StatusLog, config_message, hand_over
from impvm.agent.images import EvictedError, ImageStore, PreparedImage
from impvm.agent.network.node import GuestNetwork, NodeNetwork
from impvm.agent.qemu_accel import (
    AccelChoice,
    AcceleratorError,
    detect_accelerator,
    kernel_args,
    machine_args,
)
from impvm.agent.qemu_guest import (
    FAST_BOOT_ARGS,
    GuestAssetError,
    GuestBoot,
    Kernel,
    build_initramfs,
    find_kernel,
    pvh_image,
)
from impvm.agent.runtime import ImageError, Secret, VMRequest, VMRuntimeError
from impvm.agent.runtime_base import CONSOLE_LOG, LaunchedVM, RuntimeBase, guest_hostname
from impvm.agent.survivor import AdoptedProcess, ProcessIdentity, SecretPrint, identity_of
from impvm.agent.tools import run_tool

log = logging.getLogger("impvm.agent.qemu")

_STATUS = "status.log"
_CONTROL = "control.sock"
_SCRATCH = "scratch.ext4"
_DISK = "root.ext4"
#: QEMU's seccomp filter (qemu-options "-sandbox"): obsolete system calls, set*uid/gid,
#: fork/exec and scheduler/resource changes refused
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: The uids (each also a gid) QEMU processes run as, one per running VM, when the agent is root:
#: no passwd entry, no file owned; far above the ranges login users and subordinate ids take
QEMU_UIDS = range(3_000_000_000, 3_000_000_000 + 65536)
#: The launch record a new agent process re-attaches the VM from.
_RECORD = "qemu.json"
#: The systemd slice VMs run in when the agent runs under systemd.
VM_SLICE = "impvm-vms.slice"
#: virtio-mmio transports of QEMU's microvm machine; more devices need q35.
_MICROVM_TRANSPORTS = 8


def _control_path(workdir: Path) -> Path:
    """The VM's control socket: ``<workdir>/control.sock`` or, when that is longer than a unix
    socket path may be (108 bytes), ``/tmp/impvm-<uid>/<sha256(workdir)[:24]>.sock`` (dir 0700)."""
    p = workdir / _CONTROL
    if len(str(p).encode()) < 100:
        return p
    short = Path(f"/tmp/impvm-{os.getuid()}")  # noqa: S108 - private 0700 dir, fixed name per uid
    short.mkdir(mode=0o700, exist_ok=True)
    if short.lstat().st_uid != os.getuid() or short.is_symlink():
        raise VMRuntimeError(f"{short} is not owned by this user")
    return short / (hashlib.sha256(str(workdir).encode()).hexdigest()[:24] + ".sock")


def read_record(workdir: Path) -> dict[str, Any] | None:
    """The VM's launch record (``qemu.json``), None when there is none or it is unreadable."""
    try:
        rec = json.loads((workdir / _RECORD).read_text())
        int(rec["pid"]), str(rec["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(rec)


def _write_record(workdir: Path, rec: dict[str, Any]) -> None:
    tmp = workdir / f".{_RECORD}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, workdir / _RECORD)


def kill_recorded(workdir: Path) -> bool:
    """SIGKILL the QEMU of the VM in ``workdir`` if it still runs (found by its launch record's
    identity, never by a pid alone). Returns whether one was killed (blocking)."""
    rec = read_record(workdir)
    if rec is None:
        return False
    p = AdoptedProcess.open(ProcessIdentity(int(rec["pid"]), str(rec["start"])))
    try:
        p.kill()
    except ProcessLookupError:
        return False
    finally:
        p.close()
    return True


def kill_all_recorded(agent_workdir: Path) -> int:
    """Kill every VM the agent with ``agent_workdir`` left running (``impvm up`` stopping for
    good, tests). Returns how many were killed (blocking)."""
    vms = agent_workdir / "vms"
    if not vms.is_dir():
        return 0
    return sum(kill_recorded(d) for d in sorted(vms.iterdir()) if d.is_dir())


def systemd_scope_available() -> bool:
    """Whether VMs can get a systemd scope of their own: systemd is the init system
    (``/run/systemd/system``, sd_booted(3)), ``systemd-run`` exists and the agent is root."""
    return (
        Path("/run/systemd/system").is_dir()
        and shutil.which("systemd-run") is not None
        and os.geteuid() == 0
    )


def scope_prefix(vm_id: str) -> list[str]:
    """The ``systemd-run`` words that start a VM in a transient scope of its own in
    :data:`VM_SLICE` (``--scope`` execs the command in place: the pid is QEMU's)."""
    unit = "impvm-vm-" + hashlib.sha256(vm_id.encode()).hexdigest()[:16]
    return [
        "systemd-run",
        "--scope",
        "--quiet",
        "--collect",
        f"--slice={VM_SLICE}",
        f"--unit={unit}",
        f"--description=impvm VM {vm_id}",
        "--",
    ]


class QemuRuntime(RuntimeBase["_QemuVM"]):
    """:class:`impvm.agent.runtime.Runtime` booting each VM in QEMU (see module docstring).

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

    def _shares(self) -> tuple[list[tuple[str, Path]], dict[str, str]]:
        """Host directories shared with the guest as 9p exports ``(tag, path)``, and host
        symlinks to reproduce ``{link: target}``."""
        shares: list[tuple[str, Path]] = []
        links: dict[str, str] = {}
        for p in self.extra_ro_binds:
            if p.is_symlink():
                links[str(p)] = os.readlink(p)
            elif p.is_dir():
                shares.append((f"h{len(shares)}", p))
        return shares, links

    def _guest_config(self, req: VMRequest, net: GuestNetwork | None = None) -> list[str]:
        """The non-secret per-VM guest config (the config channel's lines before the JIT
        config): host name, VM id, its network (``net`` address/prefix gateway, ``dns``
        resolvers), shares, links. Raises :class:`VMRuntimeError` for a path the guest cannot
        take."""
        shares, links = self._shares()
        lines = [f"hostname {guest_hostname(req)}", f"vmid {req.vm_id}"]
        if net is not None:
            lines.append(f"net {net.address}/{net.prefixlen} {net.gateway}")
            lines += [f"dns {d}" for d in net.dns]
        lines += [f"share {tag} {path}" for tag, path in shares]
        lines += [f"link {link} {target}" for link, target in links.items()]
        for path in [*(str(p) for _, p in shares), *links, *links.values()]:
            if any(c.isspace() for c in path):
                raise VMRuntimeError(f"cannot share {path!r} with the guest (white space)")
        return lines

    def _qemu_args(self, req: VMRequest, files: QemuFiles, net: GuestNetwork | None) -> list[str]:
        """QEMU's command line for one VM: machine, the seccomp sandbox, kernel, serial ports,
        disks, network (the tap device of ``net``; user-mode without one), the config channel,
        shares; every file and socket is one ``files`` hands over (QEMU opens nothing itself)."""
        machine = self.accel.machine
        if machine == "microvm" and len(files.shares) + 4 > _MICROVM_TRANSPORTS:
            machine = "q35"
        sfx = "device" if machine == "microvm" else "pci"
        append = " ".join(
            [
                "console=ttyS0",
                "panic=-1",
                "loglevel=4",
                *kernel_args(self.accel.accel, machine),
                *self.boot_args,
            ]
        )
        args = [
            self.qemu,
            "-name",
            f"impvm:{req.vm_id}",
            *machine_args(self.accel.accel, machine, req.vcpu, req.memory_mib),
            "-sandbox",
            SANDBOX,
            *files.add_fd,
            "-kernel",
            files.kernel,
            "-initrd",
            files.initrd,
            "-append",
            append,
            # appended, so the agent can compact a long console in place (runtime_base)
            "-chardev",
            f"file,id=console,path={files.console},append=on",
            "-serial",
            "chardev:console",
            # ttyS1/ttyS2 as explicit ISA UARTs: microvm creates only ttyS0 from -serial
            "-chardev",
            f"file,id=status,path={files.status},append=on",
            "-device",
            "isa-serial,chardev=status,index=1",
            "-chardev",
            f"socket,id=ctl,fd={files.control_fd},server=on,wait=off",
            "-device",
            "isa-serial,chardev=ctl,index=2",
            "-drive",
            f"file={files.disk},if=none,id=root,format=raw,readonly=on",
            "-device",
            f"virtio-blk-{sfx},drive=root,serial=imp-root",
            "-drive",
            f"file={files.scratch},if=none,id=scratch,format=raw,discard=unmap",
            "-device",
            f"virtio-blk-{sfx},drive=scratch,serial=imp-scratch",
            "-netdev",
            f"tap,id=net0,fd={files.tap_fd}" if files.tap_fd is not None else "user,id=net0",
            "-device",
            f"virtio-net-{sfx},netdev=net0" + (",romfile=" if sfx == "pci" else ""),
            # the config channel: one end of a socket pair, no path (guest_io)
            "-device",
            f"virtio-serial-{sfx}",
            "-chardev",
            f"socket,id=cfg,fd={files.config_fd}",
            "-device",
            f"virtserialport,chardev=cfg,name={CONFIG_PORT}",
        ]
        for tag, path in files.shares:
            args += [
                "-fsdev",
                f"local,id=fs{tag},path={path},security_model=none,readonly=on,multidevs=remap",
                "-device",
                f"virtio-9p-{sfx},fsdev=fs{tag},mount_tag={tag}",
            ]
        return args

    def _open_files(
        self, req: VMRequest, disk: Path, net: GuestNetwork | None, held: _Held, config_fd: int
    ) -> QemuFiles:
        """Open everything QEMU of ``req`` uses (``held`` collects the descriptors to hand over
        and close): the kernel, initramfs, image and scratch disks, console and status files,
        the control socket (bound here, in the VM's private workdir), the tap device and the
        shared directories; ``config_fd`` is QEMU's end of the config channel. Raises
        OSError."""
        wd = req.workdir
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        control_fd = held.socket(ctl)
        ctl.bind(str(_control_path(wd)))
        ctl.listen(4)
        scratch = wd / _SCRATCH
        files = QemuFiles(
            kernel=held.reopen(self.kernel.boot_image),
            initrd=held.reopen(self.initramfs),
            disk=held.fdset(held.open(disk, os.O_RDONLY)),
            scratch=held.fdset(held.open(scratch, os.O_RDWR), held.open(scratch, os.O_RDONLY)),
            console=held.fdset(held.open(wd / CONSOLE_LOG, os.O_WRONLY | os.O_APPEND)),
            status=held.fdset(held.open(wd / _STATUS, os.O_WRONLY | os.O_APPEND)),
            control_fd=control_fd,
            config_fd=config_fd,
            tap_fd=held.own(_open_tap(net.ifname)) if net is not None else None,
            shares=tuple(
                (tag, held.reopen(path, os.O_RDONLY | os.O_DIRECTORY))
                for tag, path in self._shares()[0]
            ),
            add_fd=tuple(held.add_fd),
        )
        return files

    def _user(self, vm_id: str) -> list[str]:
        """The words that start QEMU as a uid of its own (``setpriv``: real, effective and saved
        uid and gid from :attr:`qemu_uids`, no supplementary group but ``/dev/kvm``'s under
        KVM, no capability, no new privileges); none when the agent is not root (QEMU then
        runs as the agent's user)."""
        if self.qemu_uids is None:
            return []
        uid = pick_uid(vm_id, self.qemu_uids, _ids_in_use())
        groups = _kvm_groups() if self.accel.accel == "kvm" else []
        return [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]

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
            message = config_message(self._guest_config(req, net), jitconfig.reveal())
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
                files = self._open_files(req, disk, net, held, config_fd)
                args = [*self._user(req.vm_id), *self._qemu_args(req, files, net)]
                if self.systemd_scope:
                    args = [*scope_prefix(req.vm_id), *args]
                # a session of its own, no parent-death signal, and not an asyncio subprocess
                # (whose transport kills it when the agent's event loop closes): the VM
                # outlives the agent
                proc = AdoptedProcess.launch(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=logfd,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    pass_fds=tuple(held.fds),
                    start_new_session=True,
                )
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
        vm.tasks.append(asyncio.create_task(self._hand_over(req, ours, message)))
        ident = identity_of(proc.pid)
        if ident is not None:  # None: it ended already, the reaper reports it
            rec = {
                "pid": ident.pid,
                "start": ident.start,
                "image": prepared.key,
                "imageDigest": prepared.image_digest,
                "layerDigest": prepared.layer_digest,
                "startedAt": vm.started_at.timestamp(),
                # to scrub the console of a re-attached VM: not the config, nothing that gives it
                "jit": SecretPrint.of(vm.secret).to_record(),
            }
            await asyncio.to_thread(_write_record, wd, rec)
        return vm

    async def _hand_over(self, req: VMRequest, sock: socket.socket, message: bytes) -> None:
        """The config channel's one delivery (:func:`impvm.agent.guest_io.hand_over`)."""
        if not await hand_over(sock, message):
            log.info("vm %s ended before its guest took its config", req.vm_id)

    async def _adopt(self, req: VMRequest) -> _QemuVM | None:
        """Re-attach the VM an earlier agent process launched (its launch record in the
        workdir): running, it is watched through a pidfd; ended, it is reported with its
        guest's exit code. None when there is no record (never launched, or cleaned up)."""
        rec = await asyncio.to_thread(read_record, req.workdir)
        if rec is None:
            return None
        proc = AdoptedProcess.open(ProcessIdentity(int(rec["pid"]), str(rec["start"])))
        key = str(rec.get("image") or "")
        prepared = await asyncio.to_thread(self.store.entry, key) or PreparedImage(
            rootfs=Path("/nonexistent"),  # evicted meanwhile: QEMU keeps its open disk
            key=key,
            image_digest=str(rec.get("imageDigest") or ""),
            layer_digest=rec.get("layerDigest"),
            size_bytes=0,
        )
        started = datetime.fromtimestamp(float(rec.get("startedAt") or time.time()), UTC)
        vm = _QemuVM(
            proc=proc,
            prepared=prepared,
            secret="",
            workdir=req.workdir,
            status=StatusLog(req.workdir / _STATUS),
        )
        vm.started_at = started
        vm.secret_print = SecretPrint.from_record(rec.get("jit"))
        if proc.returncode is not None:  # ended while no agent ran
            vm.exit_code = await self._exit_code(vm, 0)
            st = await asyncio.to_thread(_mtime, req.workdir / _STATUS)
            vm.finished_at = datetime.fromtimestamp(st, UTC) if st else datetime.now(UTC)
        return vm

    async def _exit_code(self, vm: _QemuVM, returncode: int) -> int:
        """The exit code the guest reported on its status port (the last ``IMPVM-STATUS exit
        <code>``, :class:`~impvm.agent.guest_io.StatusLog`; the guest's word, see
        :mod:`impvm.agent.guest_io`); -1 for a VM that was killed or ended without a report
        (kernel panic, QEMU error)."""
        report = await asyncio.to_thread(vm.status.drain)
        return report.exit_code if report.exit_code is not None and not vm.killed else -1

    async def _runner_started(self, vm: _QemuVM) -> bool:
        """The guest reported ``runner-start`` on its status port (read as it grows)."""
        return (await asyncio.to_thread(vm.status.poll)).runner_started

    async def _ask_to_stop(self, vm: _QemuVM) -> None:
        """``stop`` on the control port (the guest sends SIGTERM to its processes and powers off
        once the runner ended); SIGTERM to QEMU when the port does not answer."""
        try:
            async with asyncio.timeout(2.0):
                _r, w = await asyncio.open_unix_connection(str(_control_path(vm.workdir)))
                w.write(b"stop\n")
                await w.drain()
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
        except (OSError, TimeoutError):
            with contextlib.suppress(ProcessLookupError):
                vm.proc.terminate()

    def _remove_leftovers(self, workdir: Path) -> None:
        """Kill a QEMU left running by an earlier agent (by its launch record) and remove the
        control socket (which may live outside the workdir)."""
        kill_recorded(workdir)
        with contextlib.suppress(OSError, VMRuntimeError):
            _control_path(workdir).unlink(missing_ok=True)


def _probe_key(qemu: str, kernel: Path, initramfs: Path, prefer: str) -> str:
    """What an accelerator probe depends on: the machine's boot, the QEMU binary, the kernel, the
    initramfs and the preference."""
    parts: list[str] = [prefer]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    for f in (shutil.which(qemu) or qemu, kernel, initramfs):
        try:
            st = os.stat(f)
            parts.append(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(str(f))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cached_choice(cache: Path, key: str) -> AccelChoice | None:
    try:
        rec = json.loads(cache.read_text())
        if rec.get("key") != key:
            return None
        return AccelChoice(
            accel=rec["accel"],
            machine=rec["machine"],
            reason=f"{rec['reason']}; probed earlier this boot",
            boot_seconds=float(rec["boot_seconds"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_choice(cache: Path, key: str, choice: AccelChoice) -> None:
    rec = {
        "key": key,
        "accel": choice.accel,
        "machine": choice.machine,
        "reason": choice.reason,
        "boot_seconds": choice.boot_seconds,
    }
    tmp = cache.with_name(f".{cache.name}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, cache)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


@dataclass
class _QemuVM(LaunchedVM):
    """A QEMU VM: its status port's reader besides the bookkeeping every runtime keeps."""

    status: StatusLog = field(default_factory=lambda: StatusLog(Path("/nonexistent")))


@dataclass(frozen=True)
class QemuFiles:
    """What QEMU is handed for one VM, as its command line names them: ``/proc/self/fd/N``
    (a file the agent opened, reopened read-only by QEMU: the kernel, initramfs and shared
    directories), ``/dev/fdset/N`` (descriptors QEMU uses as they are, ``add_fd`` their
    ``-add-fd`` words: disks, console, status) and socket or tap descriptors."""

    kernel: str
    initrd: str
    disk: str
    scratch: str
    console: str
    status: str
    control_fd: int
    config_fd: int
    tap_fd: int | None
    shares: tuple[tuple[str, str], ...]
    add_fd: tuple[str, ...]


class _Held:
    """Descriptors opened for one launch: ``fds`` are handed to QEMU, and every one is closed
    here once QEMU has its copies (a socket through its object, never by number twice)."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.add_fd: list[str] = []
        self._own: list[int] = []
        self._sockets: list[socket.socket] = []
        self._sets = 0

    def own(self, fd: int) -> int:
        """Hand ``fd`` over, and close it afterwards."""
        self.fds.append(fd)
        self._own.append(fd)
        return fd

    def open(self, path: Path, flags: int) -> int:
        return self.own(os.open(path, flags | os.O_CLOEXEC))

    def socket(self, sock: socket.socket) -> int:
        """Hand ``sock`` over, and close it afterwards."""
        self._sockets.append(sock)
        self.fds.append(sock.fileno())
        return sock.fileno()

    def reopen(self, path: Path, flags: int = os.O_RDONLY) -> str:
        return f"/proc/self/fd/{self.open(path, flags)}"

    def fdset(self, *fds: int) -> str:
        self._sets += 1
        for fd in fds:
            self.add_fd += ["-add-fd", f"fd={fd},set={self._sets}"]
        return f"/dev/fdset/{self._sets}"

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        for fd in self._own:
            with contextlib.suppress(OSError):
                os.close(fd)


_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000


def _open_tap(ifname: str) -> int:
    """A descriptor of the (existing) tap device ``ifname``, as QEMU would attach it
    (``IFF_TAP | IFF_NO_PI | IFF_VNET_HDR``, tun(4)): the agent attaches, QEMU cannot."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH", ifname.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
    except OSError:
        os.close(fd)
        raise
    return fd


def pick_uid(vm_id: str, ids: range, taken: set[int]) -> int:
    """A uid (also the gid) of ``ids`` for VM ``vm_id`` that is not in ``taken`` (pure): the
    search starts at a place the VM id chooses, so VMs spread over the range. Raises
    :class:`VMRuntimeError` when every one is taken."""
    start = int.from_bytes(hashlib.sha256(vm_id.encode()).digest()[:8], "big") % len(ids)
    for i in range(len(ids)):
        uid = ids[(start + i) % len(ids)]
        if uid not in taken:
            return uid
    raise VMRuntimeError(f"no free uid for QEMU in {ids.start}-{ids.stop - 1}")


def _ids_in_use() -> set[int]:
    """Every uid and gid a process on this machine has (real, effective, saved, filesystem)."""
    taken: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith(("Uid:", "Gid:")):
                    taken.update(int(v) for v in line.split()[1:])
    return taken


def _kvm_groups() -> list[int]:
    """The group that may open ``/dev/kvm`` when only its group may (Debian: ``kvm``)."""
    with contextlib.suppress(OSError):
        st = os.stat("/dev/kvm")
        if st.st_mode & 0o006 != 0o006 and st.st_mode & 0o060 == 0o060:
            return [st.st_gid]
    return []


async def _run(what: str, *args: str) -> None:
    await run_tool(what, *args, error=ImageError)


async def create_qemu_runtime(
    store: ImageStore,
    state_dir: Path,
    *,
    kernel: Path | None = None,
    accelerator: Literal["auto", "kvm", "tcg"] = "auto",
    extra_ro_binds: Sequence[Path] = (),
    auth_file: Path | None = None,
    qemu: str = "qemu-system-x86_64",
    network: NodeNetwork | None = None,
    guest: GuestBoot | None = None,
) -> QemuRuntime:
    """Set up the ``qemu`` runtime at agent start: find the kernel (``kernel`` or the newest
    usable ``/boot/vmlinuz-*``), take out its PVH image and build/reuse the guest initramfs
    under ``state_dir`` (``guest``: how the guest boots, default :class:`GuestBoot`), probe the
    accelerator and machine with real boots - once per machine boot and set of binaries: a
    restarted agent (an upgrade, a crash) reuses the choice, so it is back within seconds,
    before its Lease expires and its running VMs count as lost. A PVH image that boots on no
    machine is dropped for the bzImage. Raises :class:`VMRuntimeError` when QEMU is missing or
    nothing boots (the message names each attempt)."""
    if shutil.which(qemu) is None:
        raise VMRuntimeError(f"{qemu} not found (Debian package qemu-system-x86)")
    guest = guest or GuestBoot()
    try:
        k = find_kernel(kernel, need_shares=any(p.is_dir() for p in extra_ro_binds))
        if guest.pvh:
            k, why = await pvh_image(k, state_dir / "guest")
            if why:
                log.info("guest kernel boots from its bzImage: %s", why)
        initramfs = await build_initramfs(
            k,
            state_dir / "guest",
            init=guest.init,
            applets=guest.applets,
            unsigned_modules=guest.unsigned_modules,
        )
        choice = await _choose_accelerator(qemu, k, initramfs, accelerator, guest, state_dir)
        if choice is None:  # the PVH image booted nowhere: the bzImage
            log.warning("guest kernel %s does not boot at its PVH entry; bzImage", k.path)
            k = replace(k, pvh=None)
            choice = await _choose_accelerator(qemu, k, initramfs, accelerator, guest, state_dir)
        if choice is None:  # not reached: a bzImage that boots nowhere raises
            raise AcceleratorError(f"{k.path} boots on no machine")
    except (GuestAssetError, AcceleratorError) as exc:
        raise VMRuntimeError(str(exc)) from None
    return QemuRuntime(
        store,
        kernel=k,
        initramfs=initramfs,
        accel=choice,
        state_dir=state_dir,
        extra_ro_binds=extra_ro_binds,
        auth_file=auth_file,
        qemu=qemu,
        network=network,
        boot_args=guest.kernel_args,
    )


async def _choose_accelerator(
    qemu: str,
    kernel: Kernel,
    initramfs: Path,
    accelerator: Literal["auto", "kvm", "tcg"],
    guest: GuestBoot,
    state_dir: Path,
) -> AccelChoice | None:
    """The probed accelerator and machine for booting ``kernel.boot_image`` (cached in
    ``state_dir/accelerator.json`` per machine boot and set of binaries); ``None`` when a PVH
    image boots nowhere (the caller retries with the bzImage). Raises
    :class:`AcceleratorError` when a bzImage boots nowhere."""
    image = kernel.boot_image
    key = _probe_key(qemu, image, initramfs, f"{accelerator} {' '.join(guest.kernel_args)}")
    cache = state_dir / "accelerator.json"
    choice = await asyncio.to_thread(_cached_choice, cache, key)
    if choice is None:
        try:
            choice = await detect_accelerator(
                qemu, image, initramfs, prefer=accelerator, extra_args=guest.kernel_args
            )
        except AcceleratorError:
            if kernel.pvh is None:
                raise
            return None
        await asyncio.to_thread(_write_choice, cache, key, choice)
    return choice


__all__ = ["QemuRuntime", "create_qemu_runtime", "kill_all_recorded", "kill_recorded"]
