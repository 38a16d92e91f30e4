"""Fixtures for the qemu runtime tests: real VMs (QEMU, a Debian kernel, the guest initramfs) booting
images from a real loopback registry. The runtime (accelerator probe included) is set up once per
session; on this kind of host it picks TCG."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from impvm.agent.images import ImageStore
from impvm.agent.process import host_python_binds
from impvm.agent.qemu import QemuRuntime, create_qemu_runtime
from impvm.agent.qemu_guest import GuestAssetError, find_kernel
from impvm.devstack.registry import DEFAULT_BINARY, LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

_MISSING = [
    t for t in ("skopeo", "umoci", "qemu-system-x86_64", "mkfs.ext4") if not shutil.which(t)
]
if not DEFAULT_BINARY.exists():
    _MISSING.append(str(DEFAULT_BINARY))
try:
    find_kernel()
except GuestAssetError:
    _MISSING.append("a guest kernel with 9p modules")
if _MISSING:  # scripts/setup.sh installs these: missing means a broken setup, not a skip
    pytest.fail(
        f"qemu tests need {', '.join(_MISSING)} (Debian: qemu-system-x86 linux-image-amd64 "
        "skopeo umoci docker-registry busybox-static e2fsprogs)",
        pytrace=False,
    )

# Reports what the VM looks like and checks write isolation, then exits 3.
PROBE_RUN_SH = r"""#!/bin/sh
echo "uname=$(uname -a)"
echo "jit-set=${ACTIONS_RUNNER_INPUT_JITCONFIG:+yes}"
echo "imp=${IMP_GITHUB_JITCONFIG:-unset}"
echo "allow-root=${RUNNER_ALLOW_RUNASROOT:-}"
echo "vmid=${IMP_VM_ID:-}"
# count only files a VM writes (uuid names): /tmp may also hold read-only host shares when the
# checkout lives under /tmp
uuids() { ls -A "$1" | grep -cE '^[0-9a-f]{8}-[0-9a-f]{4}-'; }
echo "before=$(uuids /tmp),$(uuids /home/runner/_work),$(ls /usr/probe-* 2>/dev/null | wc -l)"
me=$(cat /proc/sys/kernel/random/uuid)
echo "$me" > "/tmp/$me"
echo "$me" > "/home/runner/_work/$me"
echo "$me" > "/usr/probe-$me"
sleep 2
echo "after=$(uuids /tmp),$(uuids /home/runner/_work),$(ls /usr/probe-* 2>/dev/null | wc -l)"
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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def qemu_registry() -> AsyncIterator[LocalRegistry]:
    async with LocalRegistry() as reg:
        yield reg


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def qemu_images(
    qemu_registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory
) -> Images:
    work = tmp_path_factory.mktemp("qemu-images")
    addr = qemu_registry.address
    return Images(
        registry=addr,
        base=await build_base_image(work / "base", addr),
        probe=await build_runner_layer_image(
            work / "probe", addr, run_sh=PROBE_RUN_SH, tag="probe"
        ),
        sleep=await build_runner_layer_image(
            work / "sleep", addr, run_sh=SLEEP_RUN_SH, tag="sleep"
        ),
        stubborn=await build_runner_layer_image(
            work / "stubborn", addr, run_sh=STUBBORN_RUN_SH, tag="stubborn"
        ),
        standin=await build_runner_layer_image(work / "standin", addr, tag="standin"),
    )


@pytest.fixture(scope="session")
def qemu_store(
    qemu_registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory
) -> ImageStore:
    return ImageStore(tmp_path_factory.mktemp("qemu-cache"), 1 << 30, {qemu_registry.address})


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def qemu_runtime(
    qemu_store: ImageStore, tmp_path_factory: pytest.TempPathFactory
) -> QemuRuntime:
    # the host's Python (wherever the checkout is, /tmp included) for the stand-in runner
    return await create_qemu_runtime(
        qemu_store, tmp_path_factory.mktemp("qemu-state"), extra_ro_binds=host_python_binds()
    )
