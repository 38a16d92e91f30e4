"""QemuRuntime: real QEMU VMs (a Debian kernel, the guest initramfs, the probed accelerator) booting
images prepared from a real registry; the stand-in runner reaching the GitHub stand-in over the
guest network."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.qemu import QemuRuntime
from impvm.agent.runtime import Runtime, Secret, VMRequest, VMState
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.state import RunnerRec

from .conftest import Images


def _req(tmp_path: Path, name: str, image: str, layer: str | None, disk_gib: int = 1) -> VMRequest:
    return VMRequest(
        vm_id=f"test.{name}.0000",
        name=name,
        namespace="test",
        image=image,
        runner_layer=layer,
        allow_unpinned_images=False,
        vcpu=1,
        memory_mib=512,
        disk_gib=disk_gib,
        workdir=tmp_path / "vms" / name,
    )


async def _wait_for(
    rt: QemuRuntime, req: VMRequest, pred: str | None = None, seconds: float = 180
) -> VMState:
    """Poll until the VM exited (pred None) or its log tail contains ``pred``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        state = await rt.inspect(req)
        if (pred is None and state.status == "exited") or (pred and pred in state.log_tail):
            return state
        if state.status == "exited" or loop.time() > deadline:
            raise AssertionError(f"timed out or exited early; last state {state}")
        await asyncio.sleep(0.2)


def _lines(tail: str) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in tail.splitlines()
        if "=" in line and " " not in line.split("=", 1)[0]
    )


async def test_boots_a_vm_reports_kernel_and_exit_code(
    tmp_path: Path, qemu_images: Images, qemu_runtime: QemuRuntime
) -> None:
    rt = qemu_runtime
    assert isinstance(rt, Runtime) and rt.name == "qemu"
    assert rt.accel.accel in ("kvm", "tcg") and rt.accel.reason
    req = _req(tmp_path, "probe", qemu_images.base, qemu_images.probe, disk_gib=3)
    assert (await rt.inspect(req)).status == "missing"
    await rt.prepare(req)
    await rt.start(req, Secret("jit-" + secrets.token_hex(8)))
    state = await _wait_for(rt, req)
    assert state.status == "exited" and state.exit_code == 3, state
    assert state.started_at and state.finished_at and state.finished_at >= state.started_at
    # the guest init reports the kernel it booted and that it is a VM
    assert f"impvm-guest: kernel {rt.kernel.version} " in state.log_tail, state.log_tail
    assert "hypervisor=yes" in state.log_tail
    out = _lines(state.log_tail)
    assert out["uname"].startswith(f"Linux probe {rt.kernel.version} "), out  # VM name as host
    assert out["jit-set"] == "yes" and out["imp"] == "unset" and out["allow-root"] == "1"
    assert out["vmid"] == req.vm_id
    assert out["before"] == "0,0,0" and out["after"] == "1,1,1"
    assert 2_500_000 < int(out["disk"]) <= 3 * 1024 * 1024  # the scratch disk is diskGiB
    assert out["fwcfg"] == "0"  # the fw_cfg driver is gone once the runner runs
    assert (req.workdir / "console.log").stat().st_mode & 0o777 == 0o600
    await rt.cleanup(req)
    assert not req.workdir.exists()
    assert (await rt.inspect(req)).status == "missing"
    await rt.cleanup(req)  # idempotent


async def test_concurrent_vms_share_nothing_writable(
    tmp_path: Path, qemu_images: Images, qemu_runtime: QemuRuntime, qemu_store: ImageStore
) -> None:
    rt = qemu_runtime
    a, b = (_req(tmp_path, n, qemu_images.base, qemu_images.probe) for n in ("iso-a", "iso-b"))
    await rt.prepare(a)
    disk = await rt.image_disk(rt._prepared[a.vm_id])
    before = hashlib.sha256(disk.read_bytes()).hexdigest()
    await asyncio.gather(
        rt.start(a, Secret("jit-a-" + secrets.token_hex(8))),
        rt.start(b, Secret("jit-b-" + secrets.token_hex(8))),
    )
    # both run at once: each is past "runner started" before either exits
    await asyncio.gather(_wait_for(rt, a, "runner started"), _wait_for(rt, b, "runner started"))
    states = await asyncio.gather(_wait_for(rt, a), _wait_for(rt, b))
    for s in states:
        # each saw a clean /tmp, _work and /usr and, after writing, only its own files
        assert _lines(s.log_tail)["before"] == "0,0,0", s.log_tail
        assert _lines(s.log_tail)["after"] == "1,1,1", s.log_tail
    # the next VM from the same image starts clean too; the shared image disk is unchanged
    c = _req(tmp_path, "iso-c", qemu_images.base, qemu_images.probe)
    await rt.start(c, Secret("jit-c-" + secrets.token_hex(8)))
    assert _lines((await _wait_for(rt, c)).log_tail)["before"] == "0,0,0"
    assert hashlib.sha256(disk.read_bytes()).hexdigest() == before
    assert disk.stat().st_mode & 0o222 == 0
    for r in (a, b, c):
        await rt.cleanup(r)


async def test_stop_is_graceful_then_kills(
    tmp_path: Path, qemu_images: Images, qemu_runtime: QemuRuntime
) -> None:
    rt = qemu_runtime
    soft = _req(tmp_path, "sleeper", qemu_images.base, qemu_images.sleep)
    hard = _req(tmp_path, "stubborn", qemu_images.base, qemu_images.stubborn)
    await asyncio.gather(rt.start(soft, Secret("jit-s-x")), rt.start(hard, Secret("jit-h-x")))
    await asyncio.gather(_wait_for(rt, soft, "ready"), _wait_for(rt, hard, "ready"))
    assert (await rt.inspect(soft)).status == "running"
    await asyncio.gather(rt.stop(soft, grace_seconds=60), rt.stop(hard, grace_seconds=3))
    s, h = await rt.inspect(soft), await rt.inspect(hard)
    # the runner ended by SIGTERM in the guest (143) and the guest powered off by itself
    assert s.status == "exited" and s.exit_code == 143, s
    assert "stop requested" in s.log_tail
    assert h.status == "exited" and h.exit_code == -1, h  # killed after the grace period
    await rt.stop(soft)  # idempotent
    for r in (soft, hard):
        await rt.cleanup(r)
        assert not r.workdir.exists()


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                try:
                    if needle in p.read_bytes():
                        found.append(p)
                except OSError:
                    pass
    return found


def _procs_with(needle: bytes, what: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/{what}").read_bytes():
                    found.append(pid)
            except OSError:
                pass
    return found


async def test_jit_config_reaches_the_guest_only(
    tmp_path: Path, qemu_images: Images, qemu_runtime: QemuRuntime, qemu_store: ImageStore
) -> None:
    rt = qemu_runtime
    marker = "jitmarker-" + secrets.token_hex(16)
    req = _req(tmp_path, "jit", qemu_images.base, qemu_images.sleep)
    await rt.start(req, Secret(marker))
    state = await _wait_for(rt, req, "ready")
    out = _lines(state.log_tail)
    assert out["sha"] == hashlib.sha256(marker.encode()).hexdigest()  # the guest got the value
    assert out["imp"] == "unset"
    assert out["raw"] == "***" and marker not in state.log_tail  # scrubbed
    # while the VM runs: in no command line, no environment, no host file (it was a pipe)
    assert _procs_with(marker.encode(), "cmdline") == []
    assert _procs_with(marker.encode(), "environ") == []
    assert _files_containing(req.workdir, marker.encode()) == [req.workdir / "console.log"]
    await rt.stop(req, grace_seconds=30)
    assert marker not in (await rt.inspect(req)).log_tail
    await rt.cleanup(req)
    assert not req.workdir.exists()
    assert _files_containing(tmp_path, marker.encode()) == []
    assert _files_containing(rt.state_dir, marker.encode()) == []
    assert _files_containing(qemu_store.cache_dir, marker.encode()) == []


async def test_standin_runner_takes_a_job_over_the_guest_network(
    tmp_path: Path, qemu_images: Images, qemu_runtime: QemuRuntime
) -> None:
    """The test runner layer (run.sh = the stand-in runner on the host's Python, shared
    read-only) registers with the GitHub stand-in on the host's loopback, reached from the guest
    as 10.0.2.2 (user-mode networking), takes one job, and the VM powers off with exit 0."""
    rt = qemu_runtime
    standin = StandIn()
    await standin.start()
    try:
        st = standin.state
        st.base_url = f"http://10.0.2.2:{standin.port}"  # the host as the guest sees it
        st.add_org("my-org")
        st.add_repo("my-org/app")
        runner = RunnerRec(
            id=st.next_id(),
            name="vm-net",
            labels=["self-hosted", "imp"],
            group_id=1,
            org="my-org",
            repo=None,
            session_token=st.new_secret("sess_"),
            work_folder="_work",
        )
        st.runners[runner.id] = runner
        job = st.queue_job("my-org/app", ["self-hosted", "imp"], sleep_seconds=0.5)
        req = _req(tmp_path, "vm-net", qemu_images.base, qemu_images.standin)
        await rt.start(req, Secret(st.jit_config(runner)))
        state = await _wait_for(rt, req, seconds=300)
        assert state.exit_code == 0, state.log_tail
        assert f"standin-runner: vm-net job {job.id} success" in state.log_tail
        assert st.jobs[job.id].status == "completed" and st.jobs[job.id].runner_name == "vm-net"
        await rt.cleanup(req)
    finally:
        await standin.stop()
