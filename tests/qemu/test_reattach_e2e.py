"""A job inside a QEMU VM survives its agent: on the embedded stack (real control plane, operator,
GitHub stand-in, the agent as a real process, the qemu runtime) the agent is killed while a job
runs - SIGKILL (a crash), then SIGTERM (an upgrade: the process replaced) - and a new agent
process re-attaches the running VM: the job completes, the VM reports Succeeded, no second JIT
config is minted and the VM's files are removed at the end. A VM whose job ended while no agent
ran is reported with its real exit code when the agent comes back."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lightkube.resources.core_v1 import Event

from impvm.agent.qemu import read_record
from impvm.agent.survivor import identity_of
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE
from impvm.devstack.stack import Stack, wait_for

pytestmark = [pytest.mark.controlplane]

AGENT = "agent-node-1"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", runtime="qemu", polling_interval_seconds=5))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


def _vm_dir(stack: Stack, vm: dict[str, Any]) -> Path:
    meta = vm["metadata"]
    vm_id = f"{meta['namespace']}.{meta['name']}.{meta['uid'][:8]}"
    return stack.config.workdir / AGENT / "vms" / vm_id


async def _events(stack: Stack, name: str) -> list[str]:
    assert stack.kube is not None
    return [
        str(e.reason)
        async for e in stack.kube.list(Event, namespace=NAMESPACE)
        if e.involvedObject.name == name
    ]


async def _created(stack: Stack) -> int:
    """VMs the operator created so far (its metric)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{stack.operator_http_port}/metrics")).text
    return int(
        sum(float(v) for v in re.findall(r"^impvm_vms_created_total\{.*\} (\S+)$", text, re.M))
    )


def _jit_calls(stack: Stack) -> int:
    assert stack.standin is not None
    return sum(1 for r in stack.standin.state.requests if r["path"].endswith("generate-jitconfig"))


async def _running_job(stack: Stack, job_id: int) -> dict[str, Any]:
    """The VM running job ``job_id`` once its runner took it."""

    async def taken() -> dict[str, Any] | None:
        (job,) = [j for j in stack.jobs() if j.id == job_id]
        if job.status != "in_progress" or not job.runner_name:
            return None
        for v in await stack.vms():
            if v["metadata"]["name"] == job.runner_name:
                return v
        return None

    return dict(await wait_for(f"job {job_id} running in a VM", taken, 240, stack))


async def _finished(stack: Stack, job_id: int, vm: dict[str, Any], pid: int) -> None:
    """The job succeeded on ``vm``, the VM reported Succeeded (and was not Lost), its QEMU
    ended and its files are gone."""
    name = vm["metadata"]["name"]

    async def done() -> bool:
        (job,) = [j for j in stack.jobs() if j.id == job_id]
        return job.status == "completed" and "Succeeded" in await _events(stack, name)

    await wait_for(f"job {job_id} completed and its VM Succeeded", done, 240, stack)
    (job,) = [j for j in stack.jobs() if j.id == job_id]
    assert (job.conclusion, job.runner_name) == ("success", name)
    reasons = await _events(stack, name)
    assert not {"Lost", "Failed", "StartFailed"} & set(reasons), reasons
    assert reasons.count("Started") == 1, reasons  # started once, by the first agent

    async def cleaned() -> bool:
        return identity_of(pid) is None and not _vm_dir(stack, vm).exists()

    await wait_for(f"VM {name}'s QEMU ended and its files removed", cleaned, 120, stack)


@pytest.mark.timeout(1200)
async def test_a_job_survives_its_agent_being_killed_or_replaced(stack: Stack) -> None:
    assert stack.service is not None
    await wait_for("an idle runner", _idle(stack), 300, stack)

    for sig in (signal.SIGKILL, signal.SIGTERM):
        (job_id,) = stack.queue_jobs(1, sleep=20.0)
        vm = await _running_job(stack, job_id)
        rec = read_record(_vm_dir(stack, vm))
        assert rec is not None
        pid = int(rec["pid"])
        stack.service.kill(AGENT, sig)  # waits for the agent process to end
        await asyncio.sleep(1)
        assert identity_of(pid) is not None, "QEMU died with its agent"
        stack.start_agent()
        await _finished(stack, job_id, vm, pid)
        assert _jit_calls(stack) == await _created(stack)  # one JIT config per VM, no more

    # the job ends while no agent runs: the next agent reports the VM's real exit
    (job_id,) = stack.queue_jobs(1, sleep=5.0)
    vm = await _running_job(stack, job_id)
    rec = read_record(_vm_dir(stack, vm))
    assert rec is not None
    pid = int(rec["pid"])
    stack.service.kill(AGENT, signal.SIGKILL)

    async def qemu_ended() -> bool:
        return identity_of(pid) is None

    await wait_for("the VM powered off with no agent", qemu_ended, 240, stack)
    stack.start_agent()
    await _finished(stack, job_id, vm, pid)
    assert _jit_calls(stack) == await _created(stack)
    log = (stack.config.workdir / f"{AGENT}.log").read_text()
    assert "Traceback" not in log
    assert log.count("re-attached VM") >= 3 and "(ended meanwhile)" in log


def _idle(stack: Stack) -> Any:
    async def check() -> bool:
        return (await stack.pool_status()).get("idle") == 1

    return check
