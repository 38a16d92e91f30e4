"""How a VM's QEMU runs (:mod:`impvm.agent.qemu`): as a uid and gid of its own (``setpriv``, one
per running VM, no other process has it), inside QEMU's seccomp sandbox (:data:`SANDBOX`), in a
session of its own and, under systemd, in a transient scope of :data:`VM_SLICE`: so it outlives
the agent process and no VM's QEMU can signal, trace or read another's."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from impvm.agent.runtime import VMRuntimeError
from impvm.agent.survivor import AdoptedProcess

#: QEMU's seccomp filter (qemu-options "-sandbox"): obsolete system calls, set*uid/gid,
#: fork/exec and scheduler/resource changes refused
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: The uids (each also a gid) QEMU processes run as, one per running VM, when the agent is root:
#: no passwd entry, no file owned; far above the ranges login users and subordinate ids take
QEMU_UIDS = range(3_000_000_000, 3_000_000_000 + 65536)
#: The systemd slice VMs run in when the agent runs under systemd.
VM_SLICE = "impvm-vms.slice"


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


def user_words(vm_id: str, uids: range | None, accel: str) -> list[str]:
    """The words that start QEMU as a uid of its own (``setpriv``: real, effective and saved
    uid and gid from ``uids``, no supplementary group but ``/dev/kvm``'s under KVM
    (``accel``), no capability, no new privileges); none when ``uids`` is None (QEMU then
    runs as the agent's user)."""
    if uids is None:
        return []
    uid = pick_uid(vm_id, uids, _ids_in_use())
    groups = _kvm_groups() if accel == "kvm" else []
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


def launch(args: list[str], logfd: int, fds: tuple[int, ...]) -> AdoptedProcess:
    """Start QEMU's command line ``args`` (stderr to ``logfd``, ``fds`` handed over)."""
    # a session of its own, no parent-death signal, and not an asyncio subprocess
    # (whose transport kills it when the agent's event loop closes): the VM
    # outlives the agent
    return AdoptedProcess.launch(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=logfd,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        pass_fds=fds,
        start_new_session=True,
    )
