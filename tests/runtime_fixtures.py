"""Fixtures and helpers shared by every test that runs VMs through a runtime (tests/agent,
tests/qemu, tests/runtime): one real loopback registry (Debian docker-registry) with the test
images built by umoci and pushed by skopeo, one image store, and the ``qemu`` runtime (its
accelerator probe boots real VMs, so it is set up once per session). Registered for the whole
suite in tests/conftest.py."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from impvm.agent.images import ImageStore
from impvm.agent.process import host_python_binds
from impvm.agent.qemu import QemuRuntime, create_qemu_runtime
from impvm.agent.qemu_guest import GuestAssetError, find_kernel
from impvm.agent.runtime import Runtime, RuntimeState, VMRequest
from impvm.devstack.registry import DEFAULT_BINARY, LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

# Reports what the VM looks like and checks write isolation, then exits 3. Only files a VM writes
# (uuid names) are counted: /tmp may also hold read-only host shares when the checkout lives
# under /tmp.
PROBE_RUN_SH = r"""#!/bin/sh
echo "uname=$(uname -a)"
echo "jit-set=${ACTIONS_RUNNER_INPUT_JITCONFIG:+yes}"
echo "imp=${IMP_GITHUB_JITCONFIG:-unset}"
echo "allow-root=${RUNNER_ALLOW_RUNASROOT:-}"
echo "vmid=${IMP_VM_ID:-}"
if touch /usr/probe 2>/dev/null; then echo usr=writable; else echo usr=readonly; fi
if touch /home/runner/actions-runner/probe 2>/dev/null; then echo layer=writable; else echo layer=readonly; fi
uuids() { ls -A "$1" | grep -cE '^[0-9a-f]{8}-[0-9a-f]{4}-'; }
echo "scratch-before=$(uuids /tmp),$(uuids /home/runner/_work)"
echo "usr-before=$(ls /usr/probe-* 2>/dev/null | wc -l)"
me=$(cat /proc/sys/kernel/random/uuid)
echo "$me" > "/tmp/$me"
echo "$me" > "/home/runner/_work/$me"
{ echo "$me" > "/usr/probe-$me"; } 2>/dev/null
sleep 2
echo "scratch-after=$(uuids /tmp),$(uuids /home/runner/_work)"
echo "usr-after=$(ls /usr/probe-* 2>/dev/null | wc -l)"
echo "disk=$(df -k /home/runner/_work | awk 'NR==2 {print $2}')"
echo "fwcfg=$(ls /sys/firmware/qemu_fw_cfg 2>/dev/null | wc -l)"
exit 3
"""

# Shows the JIT config (hash, and raw so the scrubbing is exercised), then sleeps until stopped.
SLEEP_RUN_SH = r"""#!/bin/sh
echo "sha=$(printf %s "$ACTIONS_RUNNER_INPUT_JITCONFIG" | sha256sum | cut -d' ' -f1)"
echo "raw=$ACTIONS_RUNNER_INPUT_JITCONFIG"
echo "imp=${IMP_GITHUB_JITCONFIG:-unset}"
echo ready
exec sleep 600
"""

# Fails at start after printing its JIT config (the kept console must scrub it) and more than a
# kept console holds (about 1.5 MB), the reason last.
FAILING_RUN_SH = r"""#!/bin/sh
echo "raw=$ACTIONS_RUNNER_INPUT_JITCONFIG"
yes "console noise console noise console noise console noise" | head -n 25000
echo "runner: cannot reach GitHub: connection refused"
exit 1
"""

# Ignores SIGTERM: only the kill after the grace period ends it.
STUBBORN_RUN_SH = r"""#!/bin/sh
trap '' TERM
echo ready
while :; do sleep 1; done
"""


@dataclass(frozen=True)
class Images:
    registry: str
    base: str
    probe: str
    sleep: str
    stubborn: str
    standin: str
    failing: str


def _require(tools: list[str], debian: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None and not Path(t).exists()]
    if missing:  # scripts/setup.sh installs these: missing means a broken setup, not a skip
        pytest.fail(f"needs {', '.join(missing)} (Debian: {debian})", pytrace=False)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def registry() -> AsyncIterator[LocalRegistry]:
    _require(
        ["skopeo", "umoci", "bwrap", str(DEFAULT_BINARY), "/bin/busybox"],
        "skopeo umoci bubblewrap docker-registry busybox-static",
    )
    async with LocalRegistry() as reg:
        yield reg


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def images(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Images:
    work = tmp_path_factory.mktemp("images")
    addr = registry.address

    async def layer(tag: str, run_sh: str | None) -> str:
        return await build_runner_layer_image(work / tag, addr, run_sh=run_sh, tag=tag)

    return Images(
        registry=addr,
        base=await build_base_image(work / "base", addr),
        probe=await layer("probe", PROBE_RUN_SH),
        sleep=await layer("sleep", SLEEP_RUN_SH),
        stubborn=await layer("stubborn", STUBBORN_RUN_SH),
        standin=await layer("standin", None),
        failing=await layer("failing", FAILING_RUN_SH),
    )


@pytest.fixture(scope="session")
def shared_store(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> ImageStore:
    return ImageStore(tmp_path_factory.mktemp("cache"), 1 << 30, {registry.address})


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def qemu_runtime(
    shared_store: ImageStore, tmp_path_factory: pytest.TempPathFactory
) -> QemuRuntime:
    _require(["qemu-system-x86_64", "mkfs.ext4"], "qemu-system-x86 linux-image-amd64 e2fsprogs")
    try:
        find_kernel()
    except GuestAssetError as exc:
        pytest.fail(f"qemu tests need a guest kernel with 9p modules: {exc}", pytrace=False)
    # the host's Python (wherever the checkout is, /tmp included) for the stand-in runner
    return await create_qemu_runtime(
        shared_store, tmp_path_factory.mktemp("qemu-state"), extra_ro_binds=host_python_binds()
    )


# ---------------------------------------------------------------------------------- helpers


def vm_request(
    tmp_path: Path, name: str, image: str, layer: str | None, *, memory_mib: int, disk_gib: int = 1
) -> VMRequest:
    """A request for VM ``name`` (workdir under ``tmp_path``)."""
    return VMRequest(
        vm_id=f"test.{name}.0000",
        name=name,
        namespace="test",
        image=image,
        runner_layer=layer,
        allow_unpinned_images=False,
        vcpu=1,
        memory_mib=memory_mib,
        disk_gib=disk_gib,
        workdir=tmp_path / "vms" / name,
    )


async def wait_for(
    rt: Runtime, req: VMRequest, pred: str | None = None, seconds: float = 180
) -> RuntimeState:
    """Poll until the VM exited (``pred`` None) or its log tail contains ``pred``; fails when it
    exits without ``pred`` or ``seconds`` pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        state = await rt.inspect(req)
        if (pred is None and state.status == "exited") or (pred and pred in state.log_tail):
            return state
        if state.status == "exited" or loop.time() > deadline:
            raise AssertionError(f"timed out or exited early; last state {state}")
        await asyncio.sleep(0.1)


def tail_values(tail: str) -> dict[str, str]:
    """``key=value`` lines of a console tail (keys without spaces)."""
    return dict(
        line.split("=", 1)
        for line in tail.splitlines()
        if "=" in line and " " not in line.split("=", 1)[0]
    )


def files_containing(root: Path, needle: bytes) -> list[Path]:
    """Regular files below ``root`` whose content contains ``needle``."""
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


def procs_with(needle: bytes, what: str) -> list[str]:
    """Pids whose ``/proc/PID/<what>`` (cmdline, environ) contains ``needle``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/{what}").read_bytes():
                    found.append(pid)
            except OSError:
                pass
    return found
