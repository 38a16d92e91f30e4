"""Processes that outlive the agent: recognising one again after an agent restart, and watching
and signalling it although it is no longer the agent's child.

A VM process (QEMU) is recorded at launch by its :class:`ProcessIdentity`: the pid plus the
process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) and the kernel's
boot id (``/proc/sys/kernel/random/boot_id``). A pid alone is not enough: once the process has
exited and been reaped, the kernel may give the number to any new process (``proc(5)``), and
after a reboot every pid starts over. The pair (boot id, start time) names one process for the
life of the machine.

A new agent process opens a pidfd (``pidfd_open(2)``, Linux 5.3) for the recorded pid and only
then compares the identity: a pidfd keeps naming the process it was opened for, so a pid reused
after the check cannot redirect a later signal (``pidfd_send_signal(2)``), and the pidfd becomes
readable when the process exits, which :meth:`AdoptedProcess.wait` waits for without polling.
The exit status itself goes to the process's parent (init or a subreaper), not to the agent;
the VM's own report (its status port) gives the runner's exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: Rabin-Karp modulus (a Mersenne prime) for :class:`SecretPrint`.
_MOD = (1 << 61) - 1


@dataclass(frozen=True)
class SecretPrint:
    """What a re-attached VM's console tail is scrubbed with, instead of its JIT config (which a
    new agent process never sees: it was consumed at boot, and is kept in no file): the config's
    ``length``, a Rabin-Karp rolling hash (``base`` random per VM, ``value`` modulo 2**61-1) that
    finds candidate windows in one pass, and its ``sha256`` that confirms one. None of these gives
    the config back."""

    length: int
    base: int
    value: int
    sha256: str

    @classmethod
    def of(cls, secret: str) -> SecretPrint:
        data = secret.encode()
        base = secrets.randbelow(_MOD - 256) + 256
        value = 0
        for b in data:
            value = (value * base + b) % _MOD
        return cls(len(data), base, value, hashlib.sha256(data).hexdigest())

    def to_record(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "base": self.base,
            "value": self.value,
            "sha256": self.sha256,
        }

    @classmethod
    def from_record(cls, rec: Any) -> SecretPrint | None:
        try:
            return cls(int(rec["length"]), int(rec["base"]), int(rec["value"]), str(rec["sha256"]))
        except (TypeError, KeyError, ValueError):
            return None

    def scrub(self, text: str, mask: str = "***") -> str:
        """``text`` with every occurrence of the secret replaced by ``mask``."""
        data = text.encode()
        n = self.length
        if n == 0 or len(data) < n:
            return text
        top = pow(self.base, n - 1, _MOD)
        h = 0
        for b in data[:n]:
            h = (h * self.base + b) % _MOD
        hits: list[int] = []
        i = 0
        while True:
            if h == self.value:
                digest = hashlib.sha256(data[i : i + n]).hexdigest()
                if hmac.compare_digest(digest, self.sha256):
                    hits.append(i)
            if i + n >= len(data):
                break
            h = ((h - data[i] * top) * self.base + data[i + n]) % _MOD
            i += 1
        if not hits:
            return text
        out, last = bytearray(), 0
        for start in hits:
            if start < last:  # overlapping occurrence: already masked
                continue
            out += data[last:start] + mask.encode()
            last = start + n
        out += data[last:]
        return out.decode(errors="replace")


@dataclass(frozen=True)
class ProcessIdentity:
    """One process for the life of the machine: ``pid``, ``start`` (``<boot id>:<start time in
    clock ticks>``)."""

    pid: int
    start: str


def identity_of(pid: int) -> ProcessIdentity | None:
    """The identity of the running process ``pid`` (None when there is none, or it is a zombie:
    exited, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    state, start_ticks = fields[0], fields[19]
    if state in ("Z", "X"):
        return None
    return ProcessIdentity(pid=pid, start=f"{boot}:{start_ticks}")


class AdoptedProcess:
    """A process started by an earlier agent process (or by this one, :meth:`launch`), watched
    through a pidfd. The interface of :class:`asyncio.subprocess.Process` the runtimes use:
    ``pid``, ``returncode`` (None while it runs; once it ended its exit status when it is this
    process's child, else 0: the real status went to its parent), :meth:`wait`,
    :meth:`terminate`, :meth:`kill`."""

    def __init__(self, pid: int, pidfd: int | None, child: bool = False) -> None:
        self.pid = pid
        self._child = child
        self._fd = pidfd
        self.returncode: int | None = None if pidfd is not None else 0
        self._ended = asyncio.Event()
        if pidfd is None:
            self._ended.set()

    @classmethod
    def open(cls, identity: ProcessIdentity) -> AdoptedProcess:
        """The process ``identity`` names, or one that has already ended when it no longer runs
        (the pid is gone, a zombie, or now another process)."""
        try:
            fd = os.pidfd_open(identity.pid)
        except OSError:  # ProcessLookupError: gone
            return cls(identity.pid, None)
        if identity_of(identity.pid) != identity:  # checked after opening: see module docstring
            os.close(fd)
            return cls(identity.pid, None)
        return cls(identity.pid, fd)

    @classmethod
    def launch(cls, args: list[str], **popen: Any) -> AdoptedProcess:
        """Start ``args`` as a child of this process (``subprocess.Popen`` keywords in ``popen``)
        and watch it the same way. Unlike an asyncio subprocess, whose transport kills a child
        still running when the event loop closes, nothing here ends the child when this process
        exits: it is meant to outlive it. Raises OSError when it cannot be started."""
        proc = subprocess.Popen(args, **popen)
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # cannot happen for an unreaped child; reap it rather than leak it
            proc.kill()
            proc.wait()
            raise
        proc.returncode = 0  # never reaped through Popen: through the pidfd below
        return cls(proc.pid, fd, child=True)

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        code = 0
        if self._child:  # ours to reap (else it stays a zombie): its real status
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    code = os.waitstatus_to_exitcode(status)
        if self._fd is not None:
            loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self.returncode = code
        self._ended.set()

    async def wait(self) -> int:
        """Return once the process has ended, with :attr:`returncode`."""
        if self._fd is not None and not self._ended.is_set():
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ValueError, FileExistsError, RuntimeError):
                loop.add_reader(self._fd, self._on_exit)
        await self._ended.wait()
        return self.returncode if self.returncode is not None else 0

    def send_signal(self, sig: int) -> None:
        """Signal the process (through its pidfd: never another process that got its pid).
        Raises ProcessLookupError when it has ended."""
        if self._fd is None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Stop watching (the process itself is left alone)."""
        if self._fd is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
