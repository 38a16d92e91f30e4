"""Wake-ups after a poll, against the real API server and the GitHub stand-in: the job poller
of an installation is shared by its pools, so one pool's poll finds the jobs of the others; the
pool a new job belongs to is woken at once (its next pass makes the VM without a poll of its
own), not left to its next tick, and the pool that waited for the poll is not woken twice."""

from __future__ import annotations

import pytest

from impvm.api.models import PoolKey
from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.seed import REPO, example_scaling, pool_manifest
from impvm.operator.pool import PoolReconciler
from tests.operator.conftest import POOL, TEMPLATE, PoolEnv

pytestmark = [pytest.mark.controlplane]

RUNS_PATH = "/repos/{owner}/{repo}/actions/runs"
GPU = "gpu-pool"


async def test_a_poll_wakes_the_pool_whose_job_it_found(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=0, polling={"enabled": True, "intervalSeconds": 5})
    # a second pool of the same installation, polling once an hour, for the jobs labelled gpu
    scaling = {
        **example_scaling(),
        "minIdle": 0,
        "polling": {"enabled": True, "intervalSeconds": 3600},
    }
    body = pool_manifest(GPU, env.ns, scaling, labels=["imp", "gpu"], template=TEMPLATE)
    await env.kube.create(ImpVMRunnerPoolResource.from_dict(body))
    ci, gpu = PoolKey(env.ns, POOL), PoolKey(env.ns, GPU)
    reconciler = PoolReconciler(env.ctx)
    await reconciler.reconcile(ci)
    await reconciler.reconcile(gpu)  # both polled once (nothing queued), nothing made
    assert not await env.vms()
    for key in (ci, gpu):
        env.ctx.pool(key).wake.clear()  # what each pool's loop does before its pass

    job = env.standin.state.queue_job(REPO, ["self-hosted", "imp", "gpu"])
    env.clock.advance(5)
    await reconciler.reconcile(ci)  # ci's interval poll reads the gpu pool's job
    assert job.id in env.ctx.jobs.of(env.ctx.pool(ci).scope.installation).jobs  # type: ignore[union-attr]
    assert env.ctx.pool(gpu).wake.is_set(), "the gpu pool was left to its next tick"
    assert not env.ctx.pool(ci).wake.is_set(), "the pool that waited for the poll was woken"

    polls = len(env.requests("GET", RUNS_PATH))
    await reconciler.reconcile(gpu)  # the woken pass: the job is already in the table
    (vm,) = await env.vms()
    assert vm["metadata"]["labels"]["imp.dev/runner-pool"] == GPU
    assert len(env.requests("GET", RUNS_PATH)) == polls  # no poll of its own was needed
