"""Two operator replicas on the embedded stack: ``kill -9`` of the leader in the middle of a
burst. The standby takes over within the Lease's duration plus a few seconds, every VM got
exactly one generate-jitconfig call (the stand-in's request log), every job ran, nothing leaked;
a restarted replica stays a standby and forwards the deliveries it receives to the new leader."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from lightkube.resources.coordination_v1 import Lease

from impvm.api.models import AGENT_LEASE_NAMESPACE
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.stack import Stack, wait_for
from impvm.kube.controlplane import free_port
from impvm.operator.leader import LEADER_URL_ANNOTATION

pytestmark = [pytest.mark.controlplane]

LEASE_SECONDS = 15.0  # the operator's default
JOBS = 8


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(
        StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5, scaling_mode="hybrid")
    )
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def role(port: int) -> str:
    """``leader``, ``standby`` or ``down``, from the replica's /healthz."""
    try:
        async with httpx.AsyncClient(timeout=2) as h:
            r = await h.get(f"http://127.0.0.1:{port}/healthz")
    except httpx.HTTPError:
        return "down"
    return r.text.split()[-1] if r.status_code == 200 else "down"


async def test_kill_9_of_the_leader_mid_burst(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stack.standin is not None and stack.kube is not None
    port0, port1 = stack.operator_http_port, free_port()

    async def first_leads() -> bool:
        return await role(port0) == "leader"

    await wait_for("the first replica leading", first_leads, 60, stack)
    stack.start_operator(replica=1, port=port1)

    async def second_waits() -> bool:
        return await role(port1) == "standby"

    await wait_for("the second replica standing by", second_waits, 60, stack)
    lease = await stack.kube.get(Lease, "impvm-operator", namespace=AGENT_LEASE_NAMESPACE)
    assert lease.metadata.annotations[LEADER_URL_ANNOTATION] == f"http://127.0.0.1:{port0}"

    async def one_idle() -> bool:
        return (await stack.pool_status()).get("idle") == 1

    await wait_for("the pool's idle runner", one_idle, 180, stack)
    ids = stack.queue_jobs(JOBS, sleep=3.0)
    jobs = stack.standin.state.jobs

    async def mid_burst() -> bool:
        states = [jobs[i].status for i in ids]
        return states.count("completed") >= 1 and "queued" in states

    await wait_for("the burst under way", mid_burst, 180, stack)
    stack.kill("operator")  # SIGKILL to its session, waited for
    killed = time.monotonic()

    async def second_leads() -> bool:
        return await role(port1) == "leader"

    await wait_for("the standby taking over", second_leads, LEASE_SECONDS + 30, stack, 0.2)
    takeover = time.monotonic() - killed
    with capsys.disabled():
        print(f"\nleader takeover after kill -9: {takeover:.1f} s (lease {LEASE_SECONDS:.0f} s)")
    assert takeover < LEASE_SECONDS + 10, takeover

    # the killed replica comes back as a standby; deliveries reaching it go to the leader
    stack.start_operator()

    async def back_as_standby() -> bool:
        return await role(port0) == "standby"

    await wait_for("the restarted replica standing by", back_as_standby, 60, stack)
    delivered = len(stack.standin.state.deliveries)
    ids += stack.queue_jobs(2, sleep=1.0)

    async def all_done() -> bool:
        return all(jobs[i].status == "completed" for i in ids)

    await wait_for(f"{len(ids)} jobs completed", all_done, 300, stack)
    later = stack.standin.state.deliveries[delivered:]
    assert later and all(d.status in (200, 202) for d in later), later

    async def settled() -> bool:
        st = await stack.pool_status()
        vms = {v["metadata"]["name"] for v in await stack.vms()}
        return st.get("idle") == 1 and {r.name for r in stack.runners()} == vms

    await wait_for("the pool back at minIdle, one registration per VM", settled, 180, stack)

    # no job lost: each ran, on a runner of its own, successfully
    assert all(jobs[i].conclusion == "success" for i in ids), [jobs[i].conclusion for i in ids]
    assert len({jobs[i].runner_name for i in ids}) == len(ids)
    # exactly one generate-jitconfig call per VM, across both leaders
    mints = Counter(
        r.get("runner_name")
        for r in stack.standin.state.requests
        if r["path"].endswith("/generate-jitconfig")
    )
    assert mints and set(mints.values()) == {1}, {n: c for n, c in mints.items() if c != 1}
    assert {jobs[i].runner_name for i in ids} <= set(mints)
    # the leaders' logs tell the story; the standby never minted or reconciled
    log0 = (stack.config.workdir / "operator.log").read_text()
    log1 = (stack.config.workdir / "operator-1.log").read_text()
    assert "leading (Lease" in log0 and "leading (Lease" in log1
    assert "not the leader" not in log0 + log1
