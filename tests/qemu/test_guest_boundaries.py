"""What a job in a real QEMU guest (root there) cannot do to the host or to its own VM's record:
read its JIT config back (fw_cfg through a driver it loads itself, sysfs, the config channel),
choose the exit code the agent reports, or fill the node's disk through the status port; and the
QEMU process around it runs as a uid of its own, without capabilities, in its seccomp sandbox."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

from impvm.agent.guest_io import STATUS_MAX_BYTES, STATUS_READ_BYTES
from impvm.agent.qemu import QemuRuntime, read_record
from impvm.agent.runtime import Secret, VMRequest
from impvm.devstack.registry import LocalRegistry
from impvm.images.runner_inputs import runner_wrapper_script
from tests.agent import hostile
from tests.agent.hostile import directory, file
from tests.runtime_fixtures import Images, tail_values, vm_request, wait_for

# Reads every place the JIT config could be left, as root: fw_cfg through the driver the job
# loads itself (its module in the layer; it talks to I/O ports 0x510/0x511), sysfs, and the
# config channel's port; prints how much it found and whether the value was in it.
READ_BACK_RUN_SH = r"""#!/bin/sh
jit="$ACTIONS_RUNNER_INPUT_JITCONFIG"
unset ACTIONS_RUNNER_INPUT_JITCONFIG IMP_GITHUB_JITCONFIG
insmod /opt/qemu_fw_cfg.ko
echo "fwcfg-entries=$(ls /sys/firmware/qemu_fw_cfg/by_key 2>/dev/null | wc -l)"
echo "fwcfg-names=$(find -L /sys/firmware/qemu_fw_cfg/by_name -name raw 2>/dev/null | wc -l)"
hit=no
for f in /sys/firmware/qemu_fw_cfg/by_key/*/raw; do
    grep -q -F -e "$jit" "$f" 2>/dev/null && hit="yes:$f"
done
echo "fwcfg-hit=$hit"
grep -r -q -F -e "$jit" /sys/firmware /sys/class/virtio-ports 2>/dev/null && echo sysfs-hit=yes || echo sysfs-hit=no
ports=0
for p in /dev/vport*; do
    [ -e "$p" ] || continue
    ports=$((ports + 1))
    ( cat "$p" >"/tmp/port-$ports" 2>/dev/null ) &
    reader=$!
    sleep 2
    kill "$reader" 2>/dev/null
    echo "port-$ports-bytes=$(wc -c <"/tmp/port-$ports")"
done
echo "ports=$ports"
echo "done-reading"
exit 0
"""

# Writes a flood and forged exit lines to the status port, leaves a writer that ignores SIGTERM
# behind, and exits 3: the agent must report 3, and status.log must stay small.
FORGE_RUN_SH = r"""#!/bin/sh
echo "IMPVM-STATUS exit 0" >/dev/ttyS1
yes "IMPVM-STATUS garbage line that is not a status" | head -c 3000000 >/dev/ttyS1
printf 'IMPVM-STATUS exit 0' >/dev/ttyS1
( trap '' TERM; while :; do echo "IMPVM-STATUS exit 0" >/dev/ttyS1; done ) &
sleep 1
echo "flooded"
exit 3
"""


async def _layer(registry: LocalRegistry, work: Path, tag: str, run_sh: str, **extra: bytes) -> str:
    entries = [
        directory(d) for d in ("usr", "usr/local", "usr/local/bin", "home", "home/runner", "opt")
    ]
    entries += [directory("home/runner/actions-runner")]
    entries += [file("usr/local/bin/runner", runner_wrapper_script(), 0o755)]
    entries += [file("home/runner/actions-runner/run.sh", run_sh, 0o755)]
    entries += [file(f"opt/{name}", data) for name, data in extra.items()]
    return await hostile.push_image(work, registry.address, f"qemu-attack/{tag}", tag, [entries])


def _req(tmp_path: Path, name: str, image: str, layer: str) -> VMRequest:
    return vm_request(tmp_path, name, image, layer, memory_mib=512)


async def test_a_root_job_cannot_read_its_jit_config_back(
    tmp_path: Path, images: Images, registry: LocalRegistry, qemu_runtime: QemuRuntime
) -> None:
    """The job loads the fw_cfg driver itself (from its own layer): fw_cfg answers, and holds
    no entry with the JIT config (it used to hold ``opt/imp/jit``, readable again once the
    driver was back); neither does sysfs; the config channel's port reads nothing (the agent
    closed it after the one delivery)."""
    rt = qemu_runtime
    ko = Path(f"/lib/modules/{rt.kernel.version}/kernel/drivers/firmware/qemu_fw_cfg.ko")
    layer = await _layer(
        registry,
        tmp_path / "layer",
        "read-back",
        READ_BACK_RUN_SH,
        **{"qemu_fw_cfg.ko": await asyncio.to_thread(ko.read_bytes)},
    )
    marker = "jitmarker-" + secrets.token_hex(16)
    req = _req(tmp_path, "read-back", images.base, layer)
    await rt.start(req, Secret(marker))
    state = await wait_for(rt, req, seconds=300)
    await rt.cleanup(req)
    out = tail_values(state.log_tail)
    assert "done-reading" in state.log_tail, state.log_tail
    assert int(out["fwcfg-entries"]) > 0, state.log_tail  # the driver loaded: fw_cfg answers
    assert (out["fwcfg-hit"], out["sysfs-hit"]) == ("no", "no"), out
    assert int(out["ports"]) >= 1, out
    assert all(v == "0" for k, v in out.items() if k.startswith("port-")), out
    assert state.exit_code == 0, state


async def test_a_job_cannot_choose_the_reported_exit_code_or_flood_the_status_port(
    tmp_path: Path, images: Images, registry: LocalRegistry, qemu_runtime: QemuRuntime
) -> None:
    """The job writes 3 MB of noise and forged ``exit 0`` lines to the status port, leaves a
    writer behind that ignores SIGTERM and keeps forging, and exits 3: the agent reports 3
    (the init kills every process before its own exit line), and ``status.log`` takes little
    disk (it kept the whole flood, and was read whole every second)."""
    rt = qemu_runtime
    layer = await _layer(registry, tmp_path / "layer", "forge", FORGE_RUN_SH)
    req = _req(tmp_path, "forge", images.base, layer)
    await rt.start(req, Secret("jit-forge-" + secrets.token_hex(4)))
    state = await wait_for(rt, req, seconds=300)
    status = (req.workdir / "status.log").stat()
    await rt.cleanup(req)
    assert "flooded" in state.log_tail, state.log_tail
    assert state.exit_code == 3, state
    # the guest wrote its 3 MB (the file's size runs on), the agent freed what it read: the
    # file takes at most what one look reads beyond the cap
    assert status.st_size > 3_000_000, status
    assert status.st_blocks * 512 <= STATUS_MAX_BYTES + STATUS_READ_BYTES + 4096, status


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


async def test_qemu_runs_as_a_uid_of_its_own_without_privileges_in_its_sandbox(
    tmp_path: Path, images: Images, qemu_runtime: QemuRuntime
) -> None:
    """Two VMs: each QEMU runs as a uid and gid no other process has (never root), with no
    capability, no new privileges and QEMU's seccomp filter; neither can open the other's or
    its own private files (the workdir is root's, 0700): the agent handed everything over."""
    rt = qemu_runtime
    reqs = [_req(tmp_path, f"priv{i}", images.base, images.sleep) for i in range(2)]
    for req in reqs:
        await rt.start(req, Secret("jit-priv-" + secrets.token_hex(4)))
    try:
        for req in reqs:
            await wait_for(rt, req, "ready", 300)
        seen = []
        for req in reqs:
            rec = read_record(req.workdir)
            assert rec is not None
            st = _status(int(rec["pid"]))
            uids, gids = set(st["Uid"].split()), set(st["Gid"].split())
            assert len(uids) == 1 and uids == gids and uids != {"0"}, st
            assert st["Groups"].strip() == "" or rt.accel.accel == "kvm", st
            assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == 0, st
            assert int(st["CapBnd"], 16) == 0 and st["NoNewPrivs"] == "1", st
            assert st["Seccomp"] == "2", st  # SECCOMP_MODE_FILTER: QEMU's -sandbox
            workdir = os.stat(req.workdir)
            assert workdir.st_uid == 0 and workdir.st_mode & 0o077 == 0
            seen.append(uids)
        assert seen[0] != seen[1]  # one VM's QEMU cannot signal or trace the other
    finally:
        for req in reqs:
            await rt.cleanup(req)
