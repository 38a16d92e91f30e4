"""Fixtures for the agent tests: a real loopback registry (Debian docker-registry) with the test
images built by umoci and pushed by skopeo, shared by the session."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from impvm.agent.images import ImageStore
from impvm.devstack.registry import DEFAULT_BINARY, LocalRegistry
from impvm.devstack.testimages import build_base_image, build_runner_layer_image

_MISSING = [t for t in ("skopeo", "umoci", "bwrap") if shutil.which(t) is None]
if not DEFAULT_BINARY.exists():
    _MISSING.append(str(DEFAULT_BINARY))
if not Path("/bin/busybox").exists():
    _MISSING.append("/bin/busybox")
if _MISSING:  # scripts/setup.sh installs these: missing means a broken setup, not a skip
    pytest.fail(
        f"agent tests need {', '.join(_MISSING)} (Debian: skopeo umoci bubblewrap "
        "docker-registry busybox-static)",
        pytrace=False,
    )

# Prints what the sandbox looks like, checks scratch isolation, exits 3.
PROBE_RUN_SH = r"""#!/bin/sh
echo "uname=$(uname -a)"
echo "uid=$(id -u)"
echo "jit-set=${ACTIONS_RUNNER_INPUT_JITCONFIG:+yes}"
echo "imp=${IMP_GITHUB_JITCONFIG:-unset}"
echo "allow-root=${RUNNER_ALLOW_RUNASROOT:-}"
if touch /usr/probe 2>/dev/null; then echo usr=writable; else echo usr=readonly; fi
if touch /home/runner/actions-runner/probe 2>/dev/null; then echo layer=writable; else echo layer=readonly; fi
echo "before=$(ls -A /tmp | wc -l),$(ls -A /home/runner/_work | wc -l)"
me=$(cat /proc/sys/kernel/random/uuid)
echo "$me" > "/tmp/$me"
echo "$me" > "/home/runner/_work/$me"
sleep 1
echo "after=$(ls -A /tmp | wc -l),$(ls -A /home/runner/_work | wc -l)"
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

# Ignores SIGTERM: only the SIGKILL after the grace period ends it.
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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def registry() -> AsyncIterator[LocalRegistry]:
    async with LocalRegistry() as reg:
        yield reg


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def images(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Images:
    work = tmp_path_factory.mktemp("images")
    addr = registry.address
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
    )


@pytest.fixture(scope="session")
def shared_store(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> ImageStore:
    return ImageStore(tmp_path_factory.mktemp("cache"), 1 << 30, {registry.address})
