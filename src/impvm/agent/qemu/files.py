"""What QEMU is handed for one VM (:mod:`impvm.agent.qemu`): the files of its private workdir
(console, status, scratch disk, control socket), the descriptors the agent opens for it - QEMU
opens nothing itself - and the tap device the agent attaches."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from impvm.agent.network.node import GuestNetwork
from impvm.agent.runtime import VMRequest, VMRuntimeError
from impvm.agent.runtime_base import CONSOLE_LOG

_STATUS = "status.log"
_CONTROL = "control.sock"
_SCRATCH = "scratch.ext4"
_DISK = "root.ext4"


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


def shares(binds: Sequence[Path]) -> tuple[list[tuple[str, Path]], dict[str, str]]:
    """Host directories of ``binds`` shared with the guest as 9p exports ``(tag, path)``, and
    host symlinks to reproduce ``{link: target}``."""
    found: list[tuple[str, Path]] = []
    links: dict[str, str] = {}
    for p in binds:
        if p.is_symlink():
            links[str(p)] = os.readlink(p)
        elif p.is_dir():
            found.append((f"h{len(found)}", p))
    return found, links


def open_files(
    req: VMRequest,
    kernel: Path,
    initramfs: Path,
    binds: Sequence[Path],
    disk: Path,
    net: GuestNetwork | None,
    held: _Held,
    config_fd: int,
) -> QemuFiles:
    """Open everything QEMU of ``req`` uses (``held`` collects the descriptors to hand over
    and close): the kernel (its boot image), initramfs, image and scratch disks, console and
    status files, the control socket (bound here, in the VM's private workdir), the tap device
    and the shared directories of ``binds``; ``config_fd`` is QEMU's end of the config channel.
    Raises OSError."""
    wd = req.workdir
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control_fd = held.socket(ctl)
    ctl.bind(str(_control_path(wd)))
    ctl.listen(4)
    scratch = wd / _SCRATCH
    files = QemuFiles(
        kernel=held.reopen(kernel),
        initrd=held.reopen(initramfs),
        disk=held.fdset(held.open(disk, os.O_RDONLY)),
        scratch=held.fdset(held.open(scratch, os.O_RDWR), held.open(scratch, os.O_RDONLY)),
        console=held.fdset(held.open(wd / CONSOLE_LOG, os.O_WRONLY | os.O_APPEND)),
        status=held.fdset(held.open(wd / _STATUS, os.O_WRONLY | os.O_APPEND)),
        control_fd=control_fd,
        config_fd=config_fd,
        tap_fd=held.own(_open_tap(net.ifname)) if net is not None else None,
        shares=tuple(
            (tag, held.reopen(path, os.O_RDONLY | os.O_DIRECTORY)) for tag, path in shares(binds)[0]
        ),
        add_fd=tuple(held.add_fd),
    )
    return files
