"""The adaptive warm pool on the embedded stack (real control plane, GitHub stand-in delivering
signed webhooks, operator and agent processes): a burst of jobs raises the pool's warm target
from its observed arrival rate and time-to-ready, and a quiet spell brings it, and the pool's
idle VMs, back to minIdle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube.types import PatchType

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE
from impvm.devstack.stack import Stack, wait_for

pytestmark = [pytest.mark.controlplane]

WARM = "warm"
LABELS = ["self-hosted", WARM]


@pytest.fixture
async def warm_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", scaling_mode="webhook"))
    try:
        await s.start()
        await s.add_pool(WARM, [WARM], min_idle=0, max_concurrent=8, scale_up_step=8)
        assert s.kube is not None
        # half-life 10 s (the least allowed): a burst's effect is gone within a minute
        warm_pool = {"mode": "adaptive", "maxIdle": 4, "arrivalHalfLifeSeconds": 10}
        await s.kube.patch(
            ImpVMRunnerPoolResource,
            WARM,
            {"spec": {"scaling": {"warmPool": warm_pool}}},
            namespace=NAMESPACE,
            patch_type=PatchType.MERGE,
        )
        yield s
    finally:
        await s.stop()


async def test_an_adaptive_pool_grows_its_warm_target_under_a_burst_and_decays_after(
    warm_stack: Stack,
) -> None:
    s = warm_stack

    async def warm() -> dict[str, Any]:
        st = await s.pool_status(WARM)
        out: dict[str, Any] = st.get("warmPool") or {}
        return out

    def done(ids: list[int]) -> Any:
        async def check() -> bool:
            jobs = [j for j in s.jobs() if j.id in ids]
            return len(jobs) == len(ids) and all(j.status == "completed" for j in jobs)

        return check

    # one job first: its runner's time to ready is the first sample
    first = s.queue_jobs(1, labels=LABELS, sleep=1.0)
    await wait_for("the first job completed", done(first), 120, s, interval=0.5)

    async def sampled() -> bool:
        return bool((await warm()).get("readySamples"))

    await wait_for("a time-to-ready sample", sampled, 30, s)

    async def at_min_idle() -> bool:
        return (await warm()).get("target") == 0

    await wait_for("the first job's effect decayed", at_min_idle, 90, s)

    # a burst of 8 jobs: the target rises above minIdle (0), within maxIdle
    targets: list[int] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            t = (await warm()).get("target")
            if t is not None:
                targets.append(int(t))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    try:
        burst = s.queue_jobs(8, labels=LABELS, sleep=1.0)

        async def grown() -> bool:
            return bool(targets) and max(targets) >= 2

        await wait_for("the warm target grown by the burst", grown, 30, s, interval=0.25)
        await wait_for("the burst completed", done(burst), 180, s, interval=0.5)
    finally:
        stop.set()
        await sampler
    assert max(targets) <= 4
    runners = {j.runner_name for j in s.jobs() if j.id in first + burst}
    assert len(runners) == 9 and all(r.startswith(WARM + "-") for r in runners)

    # quiet: the estimate decays (half-life 10 s), the target returns to minIdle and the warm
    # VMs are removed
    async def decayed() -> bool:
        st = await s.pool_status(WARM)
        return (st.get("warmPool") or {}).get("target") == 0 and st.get("total") == 0

    await wait_for("the warm target back at minIdle, no VM left", decayed, 150, s)
    st = await warm()
    # a runner that took its job and finished between two passes was never seen online
    assert st["readySamples"] >= 2 and st["arrivalRatePerMinute"] > 0
