"""The ``qemu`` runtime: each VM is a QEMU (``qemu-system-x86_64``, Debian ``qemu-system-x86``)
virtual machine booting a kernel configured on the agent with the guest initramfs
(:mod:`impvm.agent.qemu_guest`), on the accelerator/machine chosen at agent start by a real probe
boot (:mod:`impvm.agent.qemu_accel`: KVM when it really boots, else TCG; ``microvm``, else
``q35``).

Disks (a VM never writes to the shared image):

* image disk (serial ``imp-root``): one ext4 file per prepared image (``mkfs.ext4 -d`` from
  :attr:`PreparedImage.rootfs`, mode 0444), kept in the image's cache entry
  (:meth:`ImageStore.derived`) so the cache's size cap counts it and eviction removes it, attached
  ``readonly=on`` to every VM of that image - QEMU refuses writes, whatever the guest does;
* scratch disk (serial ``imp-scratch``): a per-VM sparse ext4 file of ``disk_gib`` GiB in the
  VM's workdir, the upper layer of the guest's overlayfs root; deleted by :meth:`cleanup`. So a
  file one VM writes is seen by no other VM and no later VM.

Host shares (``extra_ro_binds``, development only): 9p exports with ``readonly=on`` mounted at the
same path in the guest (a host symlink is reproduced as a symlink), like the process runtime's
binds; the development stack uses them to run the host's Python inside the busybox test image.

JIT config (the runner image contract): written into a pipe whose read end QEMU gets as fw_cfg file
``opt/imp/jit`` (``file=/dev/fd/N``); QEMU reads it at start-up. It is never in a file, never on
a command line, never in a log; the guest init reads it once from
``/sys/firmware/qemu_fw_cfg/by_name/opt/imp/jit/raw``, unloads the fw_cfg driver and hands it to
``/usr/local/bin/runner`` as ``IMP_GITHUB_JITCONFIG`` only. The non-secret per-VM guest config
(host name, VM id, shares) goes the same way as ``opt/imp/config``.

Console and status: ttyS0 (kernel + init + runner output) → ``<workdir>/console.log`` (0600;
:meth:`inspect` returns its tail with the JIT config replaced by ``***``). ttyS1 →
``<workdir>/status.log``: ``IMPVM-STATUS runner-start`` then ``IMPVM-STATUS exit <code>``, written
only by the guest init (not the runner's console), which gives ``running`` and the exit code.
ttyS2 ← the unix socket ``<workdir>/control.sock``: :meth:`stop` writes ``stop`` there, the init
sends SIGTERM to every guest process and powers off when the runner ended.

Network: with a node network (:class:`impvm.agent.network.node.NodeNetwork`, the default of
``impvm agent``) each VM gets its own tap device (``-netdev tap``), NAT to the node's uplink and
its egress policy; the guest's address, gateway and resolvers arrive in ``opt/imp/config``
(``net`` and ``dns`` lines). Without one (``--guest-network host``, development only) QEMU
user-mode networking (slirp): guest 10.0.2.15/24, gateway 10.0.2.2 = the host's loopback, DNS
10.0.2.3 - no isolation at all, the guest reaches every host loopback service.

Lifetime: QEMU runs as a child of the agent with ``PR_SET_PDEATHSIG=SIGKILL``, so VMs die with
the agent (like bubblewrap's ``--die-with-parent``); after an agent restart ``inspect`` reports
``missing`` and ``cleanup`` removes what is left (QEMU's pid file is checked and a survivor
killed). Start, wait, tail, stop, cleanup and the network attach/detach are
:class:`~impvm.agent.runtime_base.RuntimeBase`'s; this module supplies the VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from impvm.agent.images import EvictedError, ImageStore, PreparedImage
from impvm.agent.network.node import GuestNetwork, NodeNetwork
from impvm.agent.qemu_accel import (
    AccelChoice,
    AcceleratorError,
    detect_accelerator,
    kernel_args,
    machine_args,
)
from impvm.agent.qemu_guest import GuestAssetError, Kernel, build_initramfs, find_kernel
from impvm.agent.runtime import ImageError, Secret, VMRequest, VMRuntimeError
from impvm.agent.runtime_base import CONSOLE_LOG, LaunchedVM, RuntimeBase, guest_hostname
from impvm.agent.tools import run_tool

_STATUS = "status.log"
_CONTROL = "control.sock"
_SCRATCH = "scratch.ext4"
_PIDFILE = "qemu.pid"
_DISK = "root.ext4"
_EXIT_RE = re.compile(rb"IMPVM-STATUS exit (-?\d+)")
_MAX_JIT_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
#: virtio-mmio transports of QEMU's microvm machine; more devices need q35.
_MICROVM_TRANSPORTS = 8


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGKILL this process when its parent (the agent) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


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


def _kill_pidfile(workdir: Path) -> None:
    """Kill a QEMU left behind by an earlier agent (pid from its pid file, only when that pid
    still runs QEMU with this VM's pid file path on its command line)."""
    pidfile = workdir / _PIDFILE
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if str(pidfile).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class QemuRuntime(RuntimeBase[LaunchedVM]):
    """:class:`impvm.agent.runtime.Runtime` booting each VM in QEMU (see module docstring).

    ``store``: the image cache (it also keeps the image disks); ``kernel``: the guest kernel;
    ``initramfs``: the guest initramfs built for it
    (:func:`impvm.agent.qemu_guest.build_initramfs`); ``accel``: the probed accelerator and machine
    (:func:`impvm.agent.qemu_accel.detect_accelerator`); ``state_dir``: agent-owned directory of
    the runtime (guest assets); ``extra_ro_binds``: host paths shared read-only at the same path;
    ``auth_file``: registry auth for pulls; ``qemu``: the QEMU executable; ``tail_lines``: lines in
    :attr:`RuntimeState.log_tail`; ``network``: the node's guest networks (``None``: user-mode
    networking, no isolation).
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
    ) -> None:
        super().__init__(store, auth_file=auth_file, tail_lines=tail_lines, network=network)
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

    def _guest_config(self, req: VMRequest, net: GuestNetwork | None = None) -> bytes:
        """The non-secret per-VM guest config (fw_cfg ``opt/imp/config``): host name, VM id,
        its network (``net`` address/prefix gateway, ``dns`` resolvers), shares, links. Raises
        :class:`VMRuntimeError` for a path the guest cannot take."""
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
        return "".join(f"{ln}\n" for ln in lines).encode()

    def _qemu_args(
        self,
        req: VMRequest,
        disk: Path,
        jit_fd: int,
        cfg_fd: int,
        net: GuestNetwork | None = None,
    ) -> list[str]:
        """QEMU's command line for one VM: machine, kernel, serial ports, disks, network (the
        tap device of ``net``; user-mode without one), fw_cfg files (read from the pipes
        ``jit_fd`` and ``cfg_fd``), shares."""
        wd = req.workdir
        shares, _ = self._shares()
        machine = self.accel.machine
        if machine == "microvm" and len(shares) + 3 > _MICROVM_TRANSPORTS:
            machine = "q35"
        sfx = "device" if machine == "microvm" else "pci"
        append = " ".join(
            ["console=ttyS0", "panic=-1", "loglevel=4", *kernel_args(self.accel.accel, machine)]
        )
        args = [
            self.qemu,
            "-name",
            f"impvm:{req.vm_id}",
            *machine_args(self.accel.accel, machine, req.vcpu, req.memory_mib),
            "-pidfile",
            str(wd / _PIDFILE),
            "-kernel",
            str(self.kernel.path),
            "-initrd",
            str(self.initramfs),
            "-append",
            append,
            # appended, so the agent can compact a long console in place (runtime_base)
            "-chardev",
            f"file,id=console,path={wd / CONSOLE_LOG},append=on",
            "-serial",
            "chardev:console",
            # ttyS1/ttyS2 as explicit ISA UARTs: microvm creates only ttyS0 from -serial
            "-chardev",
            f"file,id=status,path={wd / _STATUS}",
            "-device",
            "isa-serial,chardev=status,index=1",
            "-chardev",
            f"socket,id=ctl,path={_control_path(wd)},server=on,wait=off",
            "-device",
            "isa-serial,chardev=ctl,index=2",
            "-drive",
            f"file={disk},if=none,id=root,format=raw,readonly=on",
            "-device",
            f"virtio-blk-{sfx},drive=root,serial=imp-root",
            "-drive",
            f"file={wd / _SCRATCH},if=none,id=scratch,format=raw,discard=unmap",
            "-device",
            f"virtio-blk-{sfx},drive=scratch,serial=imp-scratch",
            "-netdev",
            f"tap,id=net0,ifname={net.ifname},script=no,downscript=no" if net else "user,id=net0",
            "-device",
            f"virtio-net-{sfx},netdev=net0" + (",romfile=" if sfx == "pci" else ""),
            "-fw_cfg",
            f"name=opt/imp/config,file=/dev/fd/{cfg_fd}",
            "-fw_cfg",
            f"name=opt/imp/jit,file=/dev/fd/{jit_fd}",
        ]
        for tag, path in shares:
            args += [
                "-fsdev",
                f"local,id=fs{tag},path={path},security_model=none,readonly=on,multidevs=remap",
                "-device",
                f"virtio-9p-{sfx},fsdev=fs{tag},mount_tag={tag}",
            ]
        return args

    async def _launch(
        self, req: VMRequest, prepared: PreparedImage, jitconfig: Secret, net: GuestNetwork | None
    ) -> LaunchedVM:
        """Boot the VM on ``net``'s tap device (user-mode networking without one); the guest's
        ``/usr/local/bin/runner`` gets ``IMP_GITHUB_JITCONFIG`` (via a pipe → fw_cfg, see module
        docstring). Raises :class:`VMRuntimeError` when the config
        cannot be passed or QEMU cannot be started (messages never contain the JIT config)."""
        disk = await self.image_disk(prepared)
        secret = jitconfig.reveal().encode()
        if len(secret) > _MAX_JIT_BYTES:
            raise VMRuntimeError(f"JIT config of VM {req.vm_id} is larger than 1 MiB")
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
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1",
            str(wd / _SCRATCH),
            f"{max(req.disk_gib, 1)}G",
        )
        os.chmod(wd / _SCRATCH, 0o600)
        config = self._guest_config(req, net)
        fds: list[int] = []
        try:
            jit_r = _pipe_with(secret, fds)
            cfg_r = _pipe_with(config, fds)
            logfd = os.open(wd / CONSOLE_LOG, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            fds.append(logfd)
            proc = await asyncio.create_subprocess_exec(
                *self._qemu_args(req, disk, jit_r, cfg_r, net),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=logfd,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                pass_fds=(jit_r, cfg_r),
                preexec_fn=_die_with_parent,
            )
        except (OSError, VMRuntimeError) as exc:
            raise VMRuntimeError(f"starting QEMU for VM {req.vm_id} failed: {exc}") from None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return LaunchedVM(proc=proc, prepared=prepared, secret=jitconfig.reveal(), workdir=wd)

    async def _exit_code(self, vm: LaunchedVM, returncode: int) -> int:
        """The guest init's report (``IMPVM-STATUS exit <code>`` on ttyS1); -1 for a VM that was
        killed or ended without a report (kernel panic, QEMU error)."""
        status = await asyncio.to_thread(_read_bytes, vm.workdir / _STATUS)
        codes = _EXIT_RE.findall(status)
        return int(codes[-1]) if codes and not vm.killed else -1

    async def _runner_started(self, vm: LaunchedVM) -> bool:
        """The guest init reported ``runner-start`` on ttyS1."""
        return b"runner-start" in await asyncio.to_thread(_read_bytes, vm.workdir / _STATUS)

    async def _ask_to_stop(self, vm: LaunchedVM) -> None:
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
        """Kill a QEMU left by an earlier agent (pid file) and remove the control socket (which
        may live outside the workdir)."""
        _kill_pidfile(workdir)
        with contextlib.suppress(OSError, VMRuntimeError):
            _control_path(workdir).unlink(missing_ok=True)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _pipe_with(data: bytes, fds: list[int]) -> int:
    """A pipe holding ``data`` with its write end closed; returns the read end (added to ``fds``
    to be closed by the caller once QEMU has it)."""
    r, w = os.pipe()
    fds.append(r)
    try:
        if len(data) > 65536:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _MAX_JIT_BYTES + 4096)
        view = memoryview(data)
        while view:
            n = os.write(w, view)
            view = view[n:]
    finally:
        os.close(w)
    return r


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
) -> QemuRuntime:
    """Set up the ``qemu`` runtime at agent start: find the kernel (``kernel`` or the newest
    usable ``/boot/vmlinuz-*``), build/reuse the guest initramfs under ``state_dir``, probe the
    accelerator and machine with real boots. Raises :class:`VMRuntimeError` when QEMU is missing
    or nothing boots (the message names each attempt)."""
    if shutil.which(qemu) is None:
        raise VMRuntimeError(f"{qemu} not found (Debian package qemu-system-x86)")
    try:
        k = find_kernel(kernel, need_shares=any(p.is_dir() for p in extra_ro_binds))
        initramfs = await build_initramfs(k, state_dir / "guest")
        choice = await detect_accelerator(qemu, k.path, initramfs, prefer=accelerator)
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
    )


__all__ = ["QemuRuntime", "create_qemu_runtime"]
