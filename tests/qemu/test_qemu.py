"""What only the ``qemu`` runtime does (the shared Runtime contract is tests/runtime): real QEMU VMs
(a Debian kernel, the guest initramfs, the probed accelerator) booting images prepared from a real
registry - the guest's kernel and firmware, the shared image disk that no VM writes, the JIT
config on no host file, image disks that go with their cache entry, and the stand-in runner
reaching the GitHub stand-in over the guest network."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from impvm.agent.images import ImageStore
from impvm.agent.qemu import QemuRuntime
from impvm.agent.runtime import Secret, VMRequest
from impvm.devstack.standin import StandIn
from impvm.devstack.standin.records import RunnerRec
from tests.runtime_fixtures import (
    Images,
    files_containing,
    procs_with,
    tail_values,
    vm_request,
    wait_for,
)


def _req(tmp_path: Path, name: str, image: str, layer: str | None, disk_gib: int = 1) -> VMRequest:
    return vm_request(tmp_path, name, image, layer, memory_mib=512, disk_gib=disk_gib)


async def test_boots_its_kernel_and_never_writes_the_shared_image_disk(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
) -> None:
    """The guest reports its kernel, scratch disk and firmware; what it writes to ``/`` stays in
    its own scratch (tests/runtime checks that no other VM sees it): the image disk every VM of
    that image boots from is read-only and unchanged."""
    rt = qemu_runtime
    assert rt.accel.accel in ("kvm", "tcg") and rt.accel.reason
    req = _req(tmp_path, "probe", images.base, images.probe, disk_gib=3)
    await rt.prepare(req)
    disk = await rt.image_disk(rt._prepared[req.vm_id])
    before = hashlib.sha256(disk.read_bytes()).hexdigest()
    await rt.start(req, Secret("jit-" + secrets.token_hex(8)))
    state = await wait_for(rt, req)
    assert state.status == "exited" and state.exit_code == 3, state
    # the guest init reports the kernel it booted and that it is a VM
    assert f"impvm-guest: kernel {rt.kernel.version} " in state.log_tail, state.log_tail
    assert "hypervisor=yes" in state.log_tail
    out = tail_values(state.log_tail)
    assert out["uname"].startswith(f"Linux probe {rt.kernel.version} "), out
    assert (out["usr"], out["usr-after"]) == ("writable", "1")  # it did write to /usr
    assert 2_500_000 < int(out["disk"]) <= 3 * 1024 * 1024  # the scratch disk is diskGiB
    assert out["fwcfg"] == "0"  # the guest loads no fw_cfg driver (nothing of the VM is there)
    assert hashlib.sha256(disk.read_bytes()).hexdigest() == before
    assert disk.stat().st_mode & 0o222 == 0
    await rt.cleanup(req)


async def test_jit_config_is_on_no_host_file(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime, shared_store: ImageStore
) -> None:
    """The JIT config reaches the guest over the config channel (a socket pair): while the VM
    runs it is in no process's environment and in no host file but the (scrubbed on read)
    console log."""
    rt = qemu_runtime
    marker = "jitmarker-" + secrets.token_hex(16)
    req = _req(tmp_path, "jit", images.base, images.sleep)
    await rt.start(req, Secret(marker))
    state = await wait_for(rt, req, "ready")
    assert tail_values(state.log_tail)["sha"] == hashlib.sha256(marker.encode()).hexdigest()
    assert procs_with(marker.encode(), "environ") == []
    assert files_containing(req.workdir, marker.encode()) == [req.workdir / "console.log"]
    await rt.stop(req, grace_seconds=30)
    await rt.cleanup(req)
    assert files_containing(rt.state_dir, marker.encode()) == []
    assert files_containing(shared_store.cache_dir, marker.encode()) == []


async def test_image_disks_go_with_their_cache_entries(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
) -> None:
    """Every prepared image gets an ext4 disk as large as its tree: the store's size cap counts
    the disks, and an evicted image takes its disk with it, so a node's disk does not fill with
    disks of images no VM uses any more."""
    store = ImageStore(tmp_path / "cache", 1 << 40, {images.registry})
    rt = QemuRuntime(
        store,
        kernel=qemu_runtime.kernel,
        initramfs=qemu_runtime.initramfs,
        accel=qemu_runtime.accel,
        state_dir=tmp_path / "qemu",
    )

    def disks() -> list[Path]:
        return [p for p in tmp_path.rglob("*.ext4") if p.is_file()]

    await rt.prepare(_req(tmp_path, "d0", images.base, images.probe))
    (disk,) = disks()
    (entry,) = store.entries()
    tree = entry.size_bytes - disk.lstat().st_blocks * 512
    # room for two trees, not for two trees with their disks
    store.max_bytes = 2 * tree + tree // 2
    for i, layer in enumerate([images.sleep, images.stubborn, images.standin], start=1):
        await rt.prepare(_req(tmp_path, f"d{i}", images.base, layer))
        assert len(disks()) == len(store.entries()) == 1, (disks(), store.entries())
    # a VM's image (retained while it runs) is never evicted, its disk neither
    vm = _req(tmp_path, "vm", images.base, images.sleep)
    await rt.start(vm, Secret("jit-d-x"))
    await rt.prepare(_req(tmp_path, "d9", images.base, images.probe))
    assert len(disks()) == 2 + 1  # two image disks and the VM's scratch disk
    await rt.cleanup(vm)


async def test_standin_runner_takes_a_job_over_the_guest_network(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
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
        req = _req(tmp_path, "vm-net", images.base, images.standin)
        await rt.start(req, Secret(st.jit_config(runner)))
        state = await wait_for(rt, req, seconds=300)
        assert state.exit_code == 0, state.log_tail
        assert f"standin-runner: vm-net job {job.id} success" in state.log_tail
        assert st.jobs[job.id].status == "completed" and st.jobs[job.id].runner_name == "vm-net"
        await rt.cleanup(req)
    finally:
        await standin.stop()
