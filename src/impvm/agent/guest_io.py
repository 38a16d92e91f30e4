"""What the agent and a QEMU guest's init say to each other, and how little the agent believes.

**Config channel** (agent → guest, once). A virtio-serial port named :data:`CONFIG_PORT` whose
host side is one end of a socket pair QEMU is handed at launch (``-chardev socket,fd=N``): it
has no path, so nothing but the agent can connect to it, and QEMU opens nothing for it. The
agent writes the VM's config (:func:`config_message`: one ``KIND VALUE...`` line each, then
``jit <JIT config>`` and ``end``); QEMU passes it on once the guest opens the port. The guest
init reads it, answers ``ok`` and closes the port; the agent then closes its end
(:func:`hand_over`), QEMU sees the peer gone and the port stays disconnected for the rest of the
VM's life: whatever opens it later reads end-of-file. The JIT config is thus nowhere the running
guest could read it again (fw_cfg, which still answers on its I/O ports, holds only QEMU's own
kernel, initramfs and command line), and a VM restored from a snapshot can be given its own
config the same way.

**Status port** (guest → agent). The init writes ``IMPVM-STATUS boot``, ``runner-start`` and
``exit <code>`` to ttyS1, which QEMU appends to ``status.log``. A root job can write there too,
without bound, so the agent reads the file as a stream (:class:`StatusLog`): from where it
stopped, at most the last :data:`STATUS_READ_BYTES` of what is new at each look, only whole lines
of at most :data:`STATUS_LINE_BYTES` of exactly that shape count, and the disk blocks of what was
read are freed, so a flood costs neither memory nor disk (a job that floods before the agent's
first look may hide its ``runner-start`` and is then taken for a runner that never started).
The init kills every other process of the guest before it writes the exit line (a newline
first, ending whatever a killed writer left half written), so the last exit line is the init's
unless the job took the guest kernel itself (it is root in the VM):
the exit code and the runner's start are **reported by the guest**. They are shown (the VM's
``exitCode``, ``Succeeded``/``Failed``, its boot timing) and never decide anything about
security, isolation or what a run cost: those stand on what the host observes (QEMU's process,
the agent's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

#: The name of the config channel's virtio-serial port (``/sys/class/virtio-ports/*/name``).
CONFIG_PORT = "imp.config"
#: The most the config message may hold, bytes (the socket pair's buffer holds it whole).
MAX_CONFIG_BYTES = 1 << 20
#: A status line longer than this (bytes, without its newline) is not the init's: skipped.
STATUS_LINE_BYTES = 128
#: The most :meth:`StatusLog.poll` reads at once, bytes.
STATUS_READ_BYTES = 64 * 1024
#: Once this much of ``status.log`` was read, the read part's disk blocks are freed, bytes.
STATUS_MAX_BYTES = 64 * 1024

_STATUS_RE = re.compile(rb"IMPVM-STATUS (boot|runner-start|exit (\d{1,3}))")


def config_message(lines: Sequence[str], jit: str) -> bytes:
    """The config channel's message: ``lines`` (non-secret, one ``KIND VALUE...`` each), then
    ``jit <jit>`` and ``end``, newline-terminated. Raises ValueError when a line or the JIT
    config holds a line break or NUL (a JIT config is one base64 string), or the message is
    over :data:`MAX_CONFIG_BYTES` (the message never quotes the JIT config)."""
    for line in lines:
        if any(c in line for c in "\n\r\0"):
            raise ValueError(f"config line {line!r} holds a line break")
    if any(c in jit for c in "\n\r\0"):
        raise ValueError("the JIT config holds a line break or NUL (it is one base64 string)")
    data = "".join(f"{ln}\n" for ln in [*lines, f"jit {jit}", "end"]).encode()
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"the guest config is larger than {MAX_CONFIG_BYTES} bytes")
    return data


async def hand_over(sock: socket.socket, message: bytes) -> bool:
    """Write ``message`` into the agent's end of the config channel, wait for the init's
    ``ok`` and close it: True when the guest acknowledged, False when the VM ended (or the port
    broke) first. The socket is closed either way, never to be reopened."""
    try:
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    except OSError:
        sock.close()
        return False
    try:
        writer.write(message)
        await writer.drain()
        return (await reader.readline()).strip() == b"ok"
    except (OSError, ValueError, asyncio.LimitOverrunError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@dataclass(frozen=True)
class GuestReport:
    """What the guest's status lines said: ``booted`` (its init runs), ``runner_started``,
    ``exit_code`` (the last exit line's code, 0-255; None: none yet)."""

    booted: bool = False
    runner_started: bool = False
    exit_code: int | None = None


@dataclass(frozen=True)
class StatusReading:
    """A reader's state: the ``report`` so far, ``pending`` bytes of a line not yet ended,
    ``skipping`` (inside a line already longer than :data:`STATUS_LINE_BYTES`)."""

    report: GuestReport = GuestReport()
    pending: bytes = b""
    skipping: bool = False


def _line(report: GuestReport, line: bytes) -> GuestReport:
    m = _STATUS_RE.fullmatch(line.rstrip(b"\r"))
    if m is None:
        return report
    if m.group(1) == b"boot":
        return replace(report, booted=True)
    if m.group(1) == b"runner-start":
        return replace(report, runner_started=True)
    code = int(m.group(2))
    return replace(report, exit_code=code) if code <= 255 else report


def read_status(state: StatusReading, chunk: bytes) -> StatusReading:
    """``state`` after the next ``chunk`` of the status port (pure): each whole line that is
    exactly ``IMPVM-STATUS boot|runner-start|exit <0-255>`` updates the report (the last exit
    line wins); anything else, and every line longer than :data:`STATUS_LINE_BYTES`, is
    skipped."""
    report, pending, skipping = state.report, state.pending, state.skipping
    *whole, rest = chunk.split(b"\n")
    for part in whole:
        if not skipping and len(pending) + len(part) <= STATUS_LINE_BYTES:
            report = _line(report, pending + part)
        pending, skipping = b"", False
    if skipping or len(pending) + len(rest) > STATUS_LINE_BYTES:
        return StatusReading(report, b"", True)
    return StatusReading(report, pending + rest, False)


class StatusLog:
    """``status.log`` of one VM, read as it grows (see the module docstring). Blocking methods:
    run them in a thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.state = StatusReading()

    @property
    def report(self) -> GuestReport:
        return self.state.report

    def poll(self, limit: int = STATUS_READ_BYTES) -> GuestReport:
        """Read what was written since the last look, at most its last ``limit`` bytes (behind
        a flood, the older part is skipped: the lines that matter come last, and nothing is
        written after the init's exit line), and return the report. Once more than
        :data:`STATUS_MAX_BYTES` were read, their blocks are given back to the file system
        (a hole punched below the read offset, fallocate(2)), so the file takes no more disk
        than what is not read yet, and QEMU's appends are never lost to a cut."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return self.report
        try:
            size = os.fstat(fd).st_size
            if size < self.offset:  # made anew: start over
                self.offset, self.state = 0, StatusReading(self.report)
            if size - self.offset > limit:
                self.offset = size - limit
                self.state = StatusReading(self.report, b"", skipping=True)
            data = os.pread(fd, size - self.offset, self.offset)
            self.offset += len(data)
            self.state = read_status(self.state, data)
            if self.offset > STATUS_MAX_BYTES:
                _punch(fd, self.offset)
        finally:
            os.close(fd)
        return self.report

    def drain(self) -> GuestReport:
        """The report once the VM has ended (nothing more is written): one last look."""
        return self.poll()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_BLOCK = 4096


def _punch(fd: int, upto: int) -> None:
    """Deallocate the whole blocks of ``fd`` below ``upto`` (its size and later bytes stay);
    where the file system cannot, the file is left as it is."""
    length = upto // _BLOCK * _BLOCK
    if length <= 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length)
