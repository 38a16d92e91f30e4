"""QEMU VMs outlive the runtime that launched them: a new runtime instance (what a new agent
process makes) re-attaches a running VM from its launch record, watches and stops it; a VM that
ended while nobody watched is reported with the exit code its guest wrote; a record whose pid now
names another process is never taken for the VM. (The agent process itself being killed and
replaced while a job runs: tests/qemu/test_reattach_e2e.py.)"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

from impvm.agent.qemu import QemuRuntime, read_record
from impvm.agent.runtime import Secret, VMRequest
from impvm.agent.survivor import SecretPrint, identity_of
from tests.runtime_fixtures import Images, vm_request, wait_for


def _req(tmp_path: Path, name: str, image: str, layer: str | None) -> VMRequest:
    return vm_request(tmp_path, name, image, layer, memory_mib=512)


def _new_runtime(old: QemuRuntime) -> QemuRuntime:
    """What a new agent process starts with: the same node, no VM known."""
    return QemuRuntime(
        old.store,
        kernel=old.kernel,
        initramfs=old.initramfs,
        accel=old.accel,
        state_dir=old.state_dir,
        extra_ro_binds=old.extra_ro_binds,
        systemd_scope=False,
    )


async def _gone(pid: int, seconds: float = 60) -> None:
    for _ in range(int(seconds * 10)):
        if identity_of(pid) is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"process {pid} still runs")


async def test_a_new_runtime_reattaches_a_running_vm_and_stops_it(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
) -> None:
    old = qemu_runtime
    req = _req(tmp_path, "survivor", images.base, images.sleep)
    jit = "jit-" + secrets.token_hex(16)
    await old.start(req, Secret(jit))
    await wait_for(old, req, "ready")
    rec = read_record(req.workdir)
    assert rec is not None
    pid = int(rec["pid"])
    assert identity_of(pid) is not None
    # the record holds nothing that gives the JIT config back
    assert jit not in (req.workdir / "qemu.json").read_text()

    new = _new_runtime(old)
    state = await new.inspect(req)
    assert state.status == "running", state
    assert "ready" in state.log_tail
    # the guest printed its JIT config (tests/runtime checks the scrubbing): still scrubbed
    assert jit not in state.log_tail and "raw=***" in state.log_tail, state.log_tail
    started = (await old.inspect(req)).started_at
    assert started is not None and state.started_at is not None
    assert abs((state.started_at - started).total_seconds()) < 1

    await new.stop(req, grace_seconds=20)
    state = await new.inspect(req)
    assert state.status == "exited", state
    await _gone(pid)
    await new.cleanup(req)
    assert not req.workdir.exists()
    await old.cleanup(req)


async def test_a_vm_that_ended_unwatched_reports_its_guests_exit_code(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
) -> None:
    old = qemu_runtime
    req = _req(tmp_path, "unwatched", images.base, images.probe)  # its runner exits 3
    await old.start(req, Secret("jit-" + secrets.token_hex(8)))
    rec = read_record(req.workdir)
    assert rec is not None
    await _gone(int(rec["pid"]), 180)

    new = _new_runtime(old)
    state = await new.inspect(req)
    assert (state.status, state.exit_code) == ("exited", 3), state
    assert state.finished_at is not None
    await new.cleanup(req)
    assert not req.workdir.exists()
    await old.cleanup(req)


async def test_a_reused_pid_is_never_taken_for_the_vm(
    tmp_path: Path, qemu_runtime: QemuRuntime
) -> None:
    """A launch record whose pid now names another process (here: a live ``sleep``, with the
    start time it would have if the VM had had that pid before a reboot): the VM is ended, no
    report -> -1, and cleanup leaves the other process alone."""
    other = await asyncio.create_subprocess_exec("sleep", "300")
    try:
        me = identity_of(other.pid)
        assert me is not None
        req = _req(tmp_path, "reused", "reg/x@sha256:" + "0" * 64, None)
        req.workdir.mkdir(parents=True, mode=0o700)
        boot, _, ticks = me.start.partition(":")
        for start in (f"{boot}:{int(ticks) - 1}", f"another-boot:{ticks}"):
            rec = {"pid": other.pid, "start": start, "image": "gone", "startedAt": 1.0}
            rec["jit"] = SecretPrint.of("x").to_record()
            (req.workdir / "qemu.json").write_text(json.dumps(rec))
            rt = _new_runtime(qemu_runtime)
            state = await rt.inspect(req)
            assert (state.status, state.exit_code) == ("exited", -1), state
            await rt.stop(req, grace_seconds=0)
            assert identity_of(other.pid) == me
        await rt.cleanup(req)
        assert identity_of(other.pid) == me and not req.workdir.exists()
    finally:
        other.kill()
        await other.wait()
