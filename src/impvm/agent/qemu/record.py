"""A VM's launch record and re-attaching it after an agent restart (:mod:`impvm.agent.qemu`):
``qemu.json`` in the VM's workdir holds QEMU's :class:`~impvm.agent.survivor.ProcessIdentity`
(pid, start time: a reused pid is never taken for the VM), its image's cache key and its start
time; a new agent process watches a running QEMU again through a pidfd, reports one that ended
while no agent ran with its guest's exit code, and kills by identity what is left."""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from impvm.agent.guest_io import StatusLog
from impvm.agent.images import ImageStore, PreparedImage
from impvm.agent.qemu.channels import _QemuVM, exit_code
from impvm.agent.qemu.files import _STATUS
from impvm.agent.runtime import VMRequest
from impvm.agent.survivor import AdoptedProcess, ProcessIdentity, SecretPrint

#: The launch record a new agent process re-attaches the VM from.
_RECORD = "qemu.json"


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


def launch_record(ident: ProcessIdentity, prepared: PreparedImage, vm: _QemuVM) -> dict[str, Any]:
    """The launch record of ``vm``, whose QEMU is ``ident``, booted from ``prepared``."""
    return {
        "pid": ident.pid,
        "start": ident.start,
        "image": prepared.key,
        "imageDigest": prepared.image_digest,
        "layerDigest": prepared.layer_digest,
        "startedAt": vm.started_at.timestamp(),
        # to scrub the console of a re-attached VM: not the config, nothing that gives it
        "jit": SecretPrint.of(vm.secret).to_record(),
    }


async def adopt(store: ImageStore, req: VMRequest) -> _QemuVM | None:
    """Re-attach the VM an earlier agent process launched (its launch record in the
    workdir): running, it is watched through a pidfd; ended, it is reported with its
    guest's exit code. None when there is no record (never launched, or cleaned up)."""
    rec = await asyncio.to_thread(read_record, req.workdir)
    if rec is None:
        return None
    proc = AdoptedProcess.open(ProcessIdentity(int(rec["pid"]), str(rec["start"])))
    key = str(rec.get("image") or "")
    prepared = await asyncio.to_thread(store.entry, key) or PreparedImage(
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
        vm.exit_code = await exit_code(vm)
        st = await asyncio.to_thread(_mtime, req.workdir / _STATUS)
        vm.finished_at = datetime.fromtimestamp(st, UTC) if st else datetime.now(UTC)
    return vm


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
