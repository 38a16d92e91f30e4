"""What the agent and a QEMU guest say to each other (:mod:`impvm.agent.qemu`), over
:mod:`impvm.agent.guest_io`: the config channel's non-secret lines and its one delivery, the
status port (ttyS1: the runner's start and exit code, the guest's word) and the control port
(ttyS2: ``stop``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from impvm.agent.guest_io import StatusLog, hand_over
from impvm.agent.network.node import GuestNetwork
from impvm.agent.qemu.files import _control_path, shares
from impvm.agent.runtime import VMRequest, VMRuntimeError
from impvm.agent.runtime_base import LaunchedVM, guest_hostname

log = logging.getLogger("impvm.agent.qemu")


@dataclass
class _QemuVM(LaunchedVM):
    """A QEMU VM: its status port's reader besides the bookkeeping every runtime keeps."""

    status: StatusLog = field(default_factory=lambda: StatusLog(Path("/nonexistent")))


def guest_config(
    req: VMRequest, binds: Sequence[Path], net: GuestNetwork | None = None
) -> list[str]:
    """The non-secret per-VM guest config (the config channel's lines before the JIT
    config): host name, VM id, its network (``net`` address/prefix gateway, ``dns``
    resolvers), shares and links of ``binds``. Raises :class:`VMRuntimeError` for a path the
    guest cannot take."""
    found, links = shares(binds)
    lines = [f"hostname {guest_hostname(req)}", f"vmid {req.vm_id}"]
    if net is not None:
        lines.append(f"net {net.address}/{net.prefixlen} {net.gateway}")
        lines += [f"dns {d}" for d in net.dns]
    lines += [f"share {tag} {path}" for tag, path in found]
    lines += [f"link {link} {target}" for link, target in links.items()]
    for path in [*(str(p) for _, p in found), *links, *links.values()]:
        if any(c.isspace() for c in path):
            raise VMRuntimeError(f"cannot share {path!r} with the guest (white space)")
    return lines


async def hand_over_config(vm_id: str, sock: socket.socket, message: bytes) -> None:
    """The config channel's one delivery (:func:`impvm.agent.guest_io.hand_over`)."""
    if not await hand_over(sock, message):
        log.info("vm %s ended before its guest took its config", vm_id)


async def exit_code(vm: _QemuVM) -> int:
    """The exit code the guest reported on its status port (the last ``IMPVM-STATUS exit
    <code>``, :class:`~impvm.agent.guest_io.StatusLog`; the guest's word, see
    :mod:`impvm.agent.guest_io`); -1 for a VM that was killed or ended without a report
    (kernel panic, QEMU error)."""
    report = await asyncio.to_thread(vm.status.drain)
    return report.exit_code if report.exit_code is not None and not vm.killed else -1


async def runner_started(vm: _QemuVM) -> bool:
    """The guest reported ``runner-start`` on its status port (read as it grows)."""
    return (await asyncio.to_thread(vm.status.poll)).runner_started


async def ask_to_stop(vm: _QemuVM) -> None:
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
