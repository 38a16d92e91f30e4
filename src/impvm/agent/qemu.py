"""The ``qemu`` runtime: each VM is a QEMU (``qemu-system-x86_64``, Debian ``qemu-system-x86``)
virtual machine booting a kernel configured on the agent with the guest initramfs
(:mod:`impvm.agent.qemu_guest`), on the accelerator/machine chosen at agent start by a real probe
boot (:mod:`impvm.agent.qemu_accel`: KVM when it really boots, else TCG; ``microvm``, else
``q35``).

Disks (issue 5 "A VM never writes to the shared image"):

* image disk (serial ``imp-root``): one ext4 file per prepared image (``mkfs.ext4 -d`` from
  :attr:`PreparedImage.rootfs`, cached under ``state_dir/disks``, mode 0444), attached
  ``readonly=on`` to every VM of that image - QEMU refuses writes, whatever the guest does;
* scratch disk (serial ``imp-scratch``): a per-VM sparse ext4 file of ``disk_gib`` GiB in the
  VM's workdir, the upper layer of the guest's overlayfs root; deleted by :meth:`cleanup`. So a
  file one VM writes is seen by no other VM and no later VM.

Host shares (``extra_ro_binds``, development only): 9p exports with ``readonly=on`` mounted at the
same path in the guest (a host symlink is reproduced as a symlink), like the process runtime's
binds; the development stack uses them to run the host's Python inside the busybox test image.

JIT config (seed 001): written into a pipe whose read end QEMU gets as fw_cfg file
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

Network: QEMU user-mode networking (slirp): guest 10.0.2.15/24, gateway 10.0.2.2 = the host's
loopback, DNS 10.0.2.3. Production needs a tap device on a bridge with NAT and an egress policy
instead (slirp lets a guest reach every host loopback service).

Lifetime: QEMU runs as a child of the agent with ``PR_SET_PDEATHSIG=SIGKILL``, so VMs die with
the agent (like bubblewrap's ``--die-with-parent``); after an agent restart :meth:`inspect`
reports ``missing`` and :meth:`cleanup` removes what is left (QEMU's pid file is checked and a
survivor killed).
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
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from impvm.agent.images import ImageStore, PreparedImage, _remove_tree
from impvm.agent.qemu_accel import (
    AccelChoice,
    AcceleratorError,
    detect_accelerator,
    kernel_args,
    machine_args,
)
from impvm.agent.qemu_guest import GuestAssetError, Kernel, build_initramfs, find_kernel
from impvm.agent.runtime import ImageError, RuntimeError_, Secret, VMRequest, VMState, VMStatus
from impvm.agent.tools import run_tool

_LOG = "console.log"
_STATUS = "status.log"
_CONTROL = "control.sock"
_SCRATCH = "scratch.ext4"
_PIDFILE = "qemu.pid"
_TAIL_BYTES = 16384
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
        raise RuntimeError_(f"{short} is not owned by this user")
    return short / (hashlib.sha256(str(workdir).encode()).hexdigest()[:24] + ".sock")


def _remove_workdir(workdir: Path) -> None:
    with contextlib.suppress(OSError, RuntimeError_):
        _control_path(workdir).unlink(missing_ok=True)
    if os.path.lexists(workdir):
        _remove_tree(workdir)
    if os.path.lexists(workdir):
        shutil.rmtree(workdir)


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


@dataclass
class _VM:
    proc: asyncio.subprocess.Process
    prepared: PreparedImage
    secret: str
    started_at: datetime
    workdir: Path
    killed: bool = False
    finished_at: datetime | None = None
    exit_code: int | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class QemuRuntime:
    """:class:`impvm.agent.runtime.Runtime` booting each VM in QEMU (see module docstring).

    ``store``: the image cache; ``kernel``: the guest kernel; ``initramfs``: the guest initramfs
    built for it (:func:`impvm.agent.qemu_guest.build_initramfs`); ``accel``: the probed
    accelerator and machine (:func:`impvm.agent.qemu_accel.detect_accelerator`); ``state_dir``:
    agent-owned directory for the cached image disks; ``extra_ro_binds``: host paths shared
    read-only at the same path; ``auth_file``: registry auth for pulls; ``qemu``: the QEMU
    executable; ``tail_lines``: lines in :attr:`VMState.log_tail`.
    """

    name = "qemu"

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
    ) -> None:
        self.store = store
        self.kernel = kernel
        self.initramfs = initramfs
        self.accel = accel
        self.state_dir = state_dir
        self.extra_ro_binds = [Path(p) for p in extra_ro_binds]
        self.auth_file = auth_file
        self.qemu = qemu
        self.tail_lines = tail_lines
        self._disks = state_dir / "disks"
        self._disks.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._disk_locks: dict[str, asyncio.Lock] = {}
        self._prepared: dict[str, PreparedImage] = {}
        self._vms: dict[str, _VM] = {}

    # ------------------------------------------------------------------ images

    async def prepare(self, req: VMRequest) -> None:
        """Pull/verify/unpack the image + runner layer through the store (cached), then build
        (or reuse) its read-only ext4 image disk. Raises :class:`ImageError`."""
        prepared = await self.store.prepare(
            req.image,
            req.runner_layer,
            allow_unpinned=req.allow_unpinned_images,
            auth_file=self.auth_file,
            public_key=req.verify_public_key,
        )
        await self.image_disk(prepared)
        self._prepared[req.vm_id] = prepared

    async def image_disk(self, prepared: PreparedImage) -> Path:
        """The read-only ext4 disk of ``prepared`` (``state_dir/disks/<key>.ext4``, 0444),
        built once with ``mkfs.ext4 -d`` (size: 1.25 x the tree + 64 MiB, no journal) and
        published atomically. Raises :class:`ImageError` when mkfs fails."""
        disk = self._disks / f"{prepared.key}.ext4"
        lock = self._disk_locks.setdefault(prepared.key, asyncio.Lock())
        async with lock:
            if disk.is_file():
                return disk
            size_mib = (prepared.size_bytes * 5 // 4) // (1 << 20) + 64
            tmp = self._disks / f".{prepared.key}.{uuid.uuid4().hex}"
            try:
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
                os.chmod(tmp, 0o444)
                os.replace(tmp, disk)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        return disk

    async def prune_disks(self) -> list[str]:
        """Delete image disks whose store entry was evicted (a running VM keeps its open file).
        Returns the removed keys."""
        live = {e.key for e in await asyncio.to_thread(self.store.entries)}
        removed = []
        for d in self._disks.glob("*.ext4"):
            if d.stem not in live:
                with contextlib.suppress(OSError):
                    d.unlink()
                    removed.append(d.stem)
        return removed

    # ------------------------------------------------------------------ launch

    def _shares(self) -> tuple[list[tuple[str, Path]], dict[str, str]]:
        shares: list[tuple[str, Path]] = []
        links: dict[str, str] = {}
        for p in self.extra_ro_binds:
            if p.is_symlink():
                links[str(p)] = os.readlink(p)
            elif p.is_dir():
                shares.append((f"h{len(shares)}", p))
        return shares, links

    def _guest_config(self, req: VMRequest) -> bytes:
        hostname = re.sub(r"[^a-z0-9-]", "-", req.name.lower())[:63].strip("-") or "impvm"
        shares, links = self._shares()
        lines = [f"hostname {hostname}", f"vmid {req.vm_id}"]
        lines += [f"share {tag} {path}" for tag, path in shares]
        lines += [f"link {link} {target}" for link, target in links.items()]
        for path in [*(str(p) for _, p in shares), *links, *links.values()]:
            if any(c.isspace() for c in path):
                raise RuntimeError_(f"cannot share {path!r} with the guest (white space)")
        return "".join(f"{ln}\n" for ln in lines).encode()

    def _qemu_args(self, req: VMRequest, disk: Path, jit_fd: int, cfg_fd: int) -> list[str]:
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
            "-serial",
            f"file:{wd / _LOG}",
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
            "user,id=net0",
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

    async def start(self, req: VMRequest, jitconfig: Secret) -> None:
        """Boot the VM; the guest's ``/usr/local/bin/runner`` gets ``IMP_GITHUB_JITCONFIG`` (via a
        pipe → fw_cfg, see module docstring). Prepares the image first when :meth:`prepare` was
        not called. Raises :class:`RuntimeError_` when the VM already runs, the config cannot be
        passed or QEMU cannot be started (messages never contain the JIT config)."""
        if req.vm_id in self._vms and self._vms[req.vm_id].exit_code is None:
            raise RuntimeError_(f"VM {req.vm_id} is already running")
        prepared = self._prepared.get(req.vm_id)
        if prepared is None or not prepared.rootfs.is_dir():
            await self.prepare(req)
            prepared = self._prepared[req.vm_id]
        disk = await self.image_disk(prepared)
        secret = jitconfig.reveal().encode()
        if len(secret) > _MAX_JIT_BYTES:
            raise RuntimeError_(f"JIT config of VM {req.vm_id} is larger than 1 MiB")
        config = self._guest_config(req)
        wd = req.workdir
        wd.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(wd, 0o700)
        for name in (_LOG, _STATUS):
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
        fds: list[int] = []
        self.store.retain(prepared.key)
        try:
            jit_r = _pipe_with(secret, fds)
            cfg_r = _pipe_with(config, fds)
            logfd = os.open(wd / _LOG, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            fds.append(logfd)
            proc = await asyncio.create_subprocess_exec(
                *self._qemu_args(req, disk, jit_r, cfg_r),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=logfd,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                pass_fds=(jit_r, cfg_r),
                preexec_fn=_die_with_parent,
            )
        except (OSError, RuntimeError_) as exc:
            self.store.release(prepared.key)
            raise RuntimeError_(f"starting QEMU for VM {req.vm_id} failed: {exc}") from None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        vm = _VM(
            proc=proc,
            prepared=prepared,
            secret=jitconfig.reveal(),
            started_at=datetime.now(UTC),
            workdir=wd,
        )
        self._vms[req.vm_id] = vm
        vm.tasks.append(asyncio.create_task(self._wait(vm)))

    async def _wait(self, vm: _VM) -> None:
        rc = await vm.proc.wait()
        status = await asyncio.to_thread(_read_bytes, vm.workdir / _STATUS)
        codes = _EXIT_RE.findall(status)
        # The guest's own report wins; a killed VM or one that ended without a report (kernel
        # panic, QEMU error: rc != 0) is -1.
        vm.exit_code = int(codes[-1]) if codes and not vm.killed else -1
        if rc != 0 and not codes and not vm.killed:
            vm.exit_code = -1
        vm.finished_at = datetime.now(UTC)

    # ------------------------------------------------------------------ observe

    def _tail(self, vm: _VM) -> str:
        try:
            with (vm.workdir / _LOG).open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - _TAIL_BYTES))
                data = f.read()
        except OSError:
            return ""
        text = data.decode(errors="replace").replace("\r", "")
        lines = text.splitlines()[-self.tail_lines :]
        out = "\n".join(lines)
        return out.replace(vm.secret, "***") if vm.secret else out

    async def inspect(self, req: VMRequest) -> VMState:
        """``starting`` (QEMU runs, the guest has not started the runner), ``running``,
        ``exited`` (``exit_code``: the runner's exit status as the guest init reported it; -1
        when QEMU was killed or ended without a report) or ``missing``. ``log_tail``: last
        ``tail_lines`` console lines, JIT config scrubbed."""
        vm = self._vms.get(req.vm_id)
        if vm is None:
            return VMState(status="missing")
        exited = vm.exit_code is not None
        tail = await asyncio.to_thread(self._tail, vm)
        if exited:
            return VMState(
                status="exited",
                exit_code=vm.exit_code,
                started_at=vm.started_at,
                finished_at=vm.finished_at,
                log_tail=tail,
            )
        status_text = await asyncio.to_thread(_read_bytes, vm.workdir / _STATUS)
        status: VMStatus = "running" if b"runner-start" in status_text else "starting"
        return VMState(status=status, started_at=vm.started_at, log_tail=tail)

    # ------------------------------------------------------------------ stop

    async def _send_stop(self, vm: _VM) -> bool:
        try:
            async with asyncio.timeout(2.0):
                _r, w = await asyncio.open_unix_connection(str(_control_path(vm.workdir)))
                w.write(b"stop\n")
                await w.drain()
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
            return True
        except (OSError, TimeoutError):
            return False

    async def stop(self, req: VMRequest, grace_seconds: float = 10.0) -> None:
        """Graceful: ``stop`` on the control port (the guest sends SIGTERM to its processes and
        powers off once the runner ended); after ``grace_seconds`` QEMU is killed (SIGKILL).
        Idempotent."""
        vm = self._vms.get(req.vm_id)
        if vm is None or vm.proc.returncode is not None:
            if vm is not None:
                await asyncio.gather(*vm.tasks, return_exceptions=True)
            return
        if grace_seconds > 0:
            deadline = time.monotonic() + grace_seconds
            if not await self._send_stop(vm):
                with contextlib.suppress(ProcessLookupError):
                    vm.proc.terminate()
            with contextlib.suppress(TimeoutError):
                left = max(deadline - time.monotonic(), 0.1)
                await asyncio.wait_for(asyncio.shield(vm.proc.wait()), left)
        if vm.proc.returncode is None:
            vm.killed = True
            with contextlib.suppress(ProcessLookupError):
                vm.proc.kill()
        await asyncio.gather(*vm.tasks, return_exceptions=True)

    async def cleanup(self, req: VMRequest) -> None:
        """Stop the VM if needed (no grace), kill a QEMU left by an earlier agent (pid file),
        release the image, remove ``req.workdir`` (console and status logs, scratch disk, control
        socket) and forget the VM and its JIT config. Idempotent."""
        await self.stop(req, grace_seconds=0)
        vm = self._vms.pop(req.vm_id, None)
        if vm is not None:
            self.store.release(vm.prepared.key)
        self._prepared.pop(req.vm_id, None)
        await asyncio.to_thread(_kill_pidfile, req.workdir)
        await asyncio.to_thread(_remove_workdir, req.workdir)

    def describe(self) -> Mapping[str, str]:
        """Facts to advertise for this node: accelerator, machine, kernel."""
        return {
            "accelerator": self.accel.accel,
            "machine": self.accel.machine,
            "kernel": self.kernel.version,
        }


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
) -> QemuRuntime:
    """Set up the ``qemu`` runtime at agent start: find the kernel (``kernel`` or the newest
    usable ``/boot/vmlinuz-*``), build/reuse the guest initramfs under ``state_dir``, probe the
    accelerator and machine with real boots. Raises :class:`RuntimeError_` when QEMU is missing
    or nothing boots (the message names each attempt)."""
    if shutil.which(qemu) is None:
        raise RuntimeError_(f"{qemu} not found (Debian package qemu-system-x86)")
    try:
        k = find_kernel(kernel, need_shares=any(p.is_dir() for p in extra_ro_binds))
        initramfs = await build_initramfs(k, state_dir / "guest")
        choice = await detect_accelerator(qemu, k.path, initramfs, prefer=accelerator)
    except (GuestAssetError, AcceleratorError) as exc:
        raise RuntimeError_(str(exc)) from None
    return QemuRuntime(
        store,
        kernel=k,
        initramfs=initramfs,
        accel=choice,
        state_dir=state_dir,
        extra_ro_binds=extra_ro_binds,
        auth_file=auth_file,
        qemu=qemu,
    )


__all__ = ["QemuRuntime", "create_qemu_runtime"]
