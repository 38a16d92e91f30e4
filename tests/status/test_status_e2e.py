"""``impvm status`` against the embedded stack, run as a user runs it (a process with the
stack's kubeconfig): the table, ``-o json``, ``-n``, and ``--watch`` redrawing in a real
terminal (tmux). A pool whose VMs fit on no node shows ``Unschedulable`` with the free and
needed resources, and its VM among those waiting for a node."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from impvm.api.models import POOL_LABEL
from impvm.api.resources import ImpVMClassResource, ImpVMTemplateResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, POOL
from impvm.devstack.stack import Stack, wait_for

pytestmark = [pytest.mark.controlplane]

BIG_POOL = "big-pool"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


def impvm(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(stack.kubeconfig), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "impvm.cli", "status", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def add_big_pool(stack: Stack) -> None:
    """A class bigger than the agent offers (16 vCPU), its template and a pool with minIdle 1."""
    kube = stack.kube
    assert kube is not None
    await kube.create(
        ImpVMClassResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMClass",
                "metadata": {"name": "huge"},
                "spec": {"vcpu": 64, "memoryMiB": 4096, "diskGiB": 10},
            }
        )
    )
    tmpl = (await kube.get(ImpVMTemplateResource, "gh-runner", namespace=NAMESPACE)).to_dict()
    spec = dict(tmpl["spec"], classRef={"name": "huge"})
    await kube.create(
        ImpVMTemplateResource.from_dict(
            {
                "apiVersion": "imp.dev/v1alpha1",
                "kind": "ImpVMTemplate",
                "metadata": {"name": "huge", "namespace": NAMESPACE},
                "spec": spec,
            }
        )
    )
    await stack.add_pool(BIG_POOL, ["self-hosted", "huge"], min_idle=1, extra={"template": "huge"})


async def test_status_shows_pools_vms_agents_and_unschedulable(stack: Stack) -> None:
    async def one_idle() -> bool:
        runners = stack.runners()
        return len(runners) == 1 and runners[0].status == "online" and not runners[0].busy

    await wait_for("one idle registered runner", one_idle, 180, stack)
    await add_big_pool(stack)

    async def unschedulable() -> dict[str, Any] | None:
        st = await stack.pool_status(BIG_POOL)
        conds = {c["type"]: c for c in st.get("conditions") or []}
        c = conds.get("Unschedulable")
        return c if c and c["status"] == "True" else None

    cond = await wait_for("big pool Unschedulable", unschedulable, 90, stack)
    assert cond["reason"] == "InsufficientCapacity"
    assert "each needs 64 vCPU, 4096 MiB" in cond["message"]
    assert "node-1 16/16 vCPU" in cond["message"] or "node-1 14/16 vCPU" in cond["message"]

    # the table
    proc = await asyncio.to_thread(impvm, stack)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "None" not in out
    for text in (
        f"{NAMESPACE}/{POOL}",
        f"{NAMESPACE}/{BIG_POOL}",
        "Ready=True",
        "Unschedulable=True InsufficientCapacity",
        "VMs waiting for a node",
        "node-1",
        "process",
        "GitHub rate limit per installation",
        "Last warning Events",
    ):
        assert text in out, (text, out)

    # the same data as JSON
    proc = await asyncio.to_thread(impvm, stack, "-o", "json", "-n", NAMESPACE)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    pools = {p["name"]: p for p in doc["pools"]}
    assert pools[POOL]["idle"] == 1 and pools[POOL]["busy"] == 0
    # the idle VM's timings, and the pool's registration time of the last hour
    (idle,) = [v for v in await stack.vms() if v["metadata"]["labels"].get(POOL_LABEL) == POOL]
    timings = idle["status"]["timings"]
    assert {"createdAt", "scheduledAt", "bootedAt", "runnerOnlineAt"} <= set(timings)
    assert pools[POOL]["timings"]["runnerRegistration"]["count"] >= 1
    (agent,) = doc["agents"]
    assert agent["node"] == "node-1" and agent["vcpu"] == 16 and agent["live"] is True
    assert agent["runtime"] == "process"
    assert agent["preflight"] == "ok"  # the agent ran the host preflight at start
    assert [v["pool"] for v in doc["vms"]["waitingForNode"]] == [BIG_POOL]
    (limit,) = doc["rateLimits"]
    assert limit["remaining"] > 0 and sorted(limit["pools"]) == sorted([POOL, BIG_POOL])
    assert any(e["reason"] == "Unschedulable" for e in doc["events"])
    # another namespace has none of it
    proc = await asyncio.to_thread(impvm, stack, "-o", "json", "-n", "kube-system")
    assert json.loads(proc.stdout)["pools"] == []
    # a kubeconfig that does not exist: one line, exit 2
    proc = await asyncio.to_thread(impvm, stack, "--kubeconfig", "/nonexistent/config")
    assert proc.returncode == 2 and "no usable kubeconfig" in proc.stderr

    # --watch redraws in a terminal
    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed")
    session = f"impvm-status-{uuid.uuid4().hex[:8]}"
    cmd = (
        f"COLUMNS=220 LINES=80 KUBECONFIG={stack.kubeconfig} {sys.executable} -m impvm.cli "
        "status --watch "
        f"--interval 1 -n {NAMESPACE}"
    )
    tmux = ["tmux", "-L", session]  # a server of its own, gone with the session
    new = [*tmux, "new-session", "-d", "-s", session, "-x", "220", "-y", "80", cmd]
    await asyncio.to_thread(subprocess.run, new, check=True)
    await asyncio.to_thread(
        subprocess.run, [*tmux, "set-option", "-t", session, "remain-on-exit", "on"], check=True
    )
    try:

        async def screen() -> str:
            shot = await asyncio.to_thread(
                subprocess.run,
                [*tmux, "capture-pane", "-p", "-t", session],
                capture_output=True,
                text=True,
            )
            return shot.stdout

        async def shows(text: str) -> str | None:
            shot = await screen()
            return shot if text in shot else None

        try:
            first = await wait_for("the watch view", lambda: shows(BIG_POOL), 30, stack)
        except TimeoutError:
            raise AssertionError(await screen()) from None
        assert "Unschedulable=True" in first and "None" not in first
        stamp = next(ln for ln in first.splitlines() if "impvm status at" in ln)

        async def redrawn() -> str | None:
            shot = await screen()
            lines = [ln for ln in shot.splitlines() if "impvm status at" in ln]
            return shot if lines and lines[-1] != stamp else None

        again = await wait_for("a redraw", redrawn, 30, stack)
        assert BIG_POOL in again
    finally:
        await asyncio.to_thread(subprocess.run, [*tmux, "kill-server"], check=False)
