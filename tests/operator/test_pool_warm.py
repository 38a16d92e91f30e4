"""The warm pool in the pool controller, against the real API server and the GitHub stand-in, one
pass at a time with the operator's clock moved by the test: polled jobs and runners coming
online are folded into status.warmPool once, and the status is written only when it changed."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from impvm.devstack.seed import REPO
from tests.operator.conftest import PoolEnv

pytestmark = [pytest.mark.controlplane]

ADAPTIVE = {"mode": "adaptive", "maxIdle": 3, "arrivalHalfLifeSeconds": 60}


async def test_jobs_and_first_online_runners_are_folded_once_and_the_target_decays(
    env: PoolEnv,
) -> None:
    await env.ready_pool(minIdle=0, scaleUpStep=5, cooldownSeconds=0, warmPool=ADAPTIVE)
    for _ in range(3):
        env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    await env.run_pass()  # the first pass polls: three jobs arrive, three VMs for them
    warm = (await env.status())["warmPool"]
    assert math.isclose(warm["arrivalRatePerMinute"], 3 * math.log(2), rel_tol=1e-6)
    assert warm["target"] == 0 and "readySeconds" not in warm  # no time-to-ready yet
    assert len(await env.vms()) == 3

    await env.bring_online()
    await env.pass_after(20)  # the VMs were created a few (real) seconds after the clock read
    warm = (await env.status())["warmPool"]
    assert warm["readySamples"] == 3 and 0 < warm["readySeconds"] <= 21  # whole seconds
    assert 1 <= warm["target"] <= 2  # ceil(~1.7 jobs/min x 15..20 s x 2.5 / 60)
    assert len(await env.vms()) == 3 + warm["target"]  # the queued jobs' and the warm runners
    updated = dt.datetime.fromisoformat(warm["updatedAt"])

    # nothing new at the same clock reading: the pool is not written again (one pass first: the
    # warm VMs just made, seen by a clock ahead of their creation, now wait for a node, which the
    # Unschedulable condition reports once)
    await env.run_pass()
    version = (await env.pool())["metadata"]["resourceVersion"]
    await env.run_pass()
    assert (await env.pool())["metadata"]["resourceVersion"] == version

    # ten minutes on, the next polls see the same queued jobs (no new arrival): the estimate has
    # decayed and only the target changes
    await env.pass_after(600)
    later = (await env.status())["warmPool"]
    assert later["target"] == 0
    assert dt.datetime.fromisoformat(later["updatedAt"]) == updated
    assert later["arrivalRatePerMinute"] == warm["arrivalRatePerMinute"]
    resized = [e.message or "" for e in env.events_with("WarmPoolResized")]
    assert any(m.startswith(f"warm pool target {warm['target']} -> 0: adaptive") for m in resized)
