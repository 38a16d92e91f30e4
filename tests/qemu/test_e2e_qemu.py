"""The end-to-end pool test (tests/e2e) with the ``qemu`` runtime: every job runs in a real booted
VM. As root (here, and in CI) each VM has its own tap device behind the agent's egress policy and
reaches the GitHub stand-in in its "internet" namespace through the node's NAT; otherwise the
stack falls back to user-mode networking (the stand-in on loopback, seen as 10.0.2.2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from impvm.devstack.devconfig import StackConfig
from impvm.devstack.stack import Stack
from tests.e2e import test_pool_e2e as e2e

pytestmark = [pytest.mark.controlplane]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", runtime="qemu", polling_interval_seconds=5))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


@pytest.mark.timeout(900)
async def test_seed_example_on_qemu_vms(stack: Stack) -> None:
    await e2e.test_seed_example_runs_jobs_each_on_its_own_vm(stack)
    # every job ran in a booted VM: the agent's VMs reported their kernel on the console
    logs = stack.logs()
    assert "qemu runtime: kernel" in logs
