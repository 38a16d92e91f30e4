"""A ``manual`` pool's demand is its minIdle and its demand annotation only: queued jobs are
never routed to it, so it takes none from a pool that observes them, even when it is the older
of two pools that fit a job equally well (routing ties go to the older). Real API server, the
GitHub stand-in, one pass at a time."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.seed import REPO
from impvm.operator.pool import PoolReconciler
from impvm.scaling.jobs import Job, PoolScope, candidates
from impvm.scaling.labels import PoolLabels
from tests.operator.conftest import PoolEnv

pytestmark = [pytest.mark.controlplane]

MANUAL = "manual-pool"


async def test_an_older_manual_pool_takes_no_queued_job(env: PoolEnv) -> None:
    await env.create_class_and_template()
    await env.create_credentials()
    await env.create_pool(MANUAL, mode="manual", polling=None, minIdle=1)
    made = await env.kube.get(ImpVMRunnerPoolResource, MANUAL, namespace=env.ns)
    created = made.metadata.creationTimestamp  # type: ignore[union-attr]
    assert created is not None
    deadline = time.time() + 10
    while time.time() < created.timestamp() + 1.05:  # whole seconds: "older" must show
        assert time.time() < deadline
        await asyncio.sleep(0.05)
    await env.create_pool()  # POOL: polling, same labels, made a second later
    manual = PoolReconciler(env.ctx)
    await manual.reconcile((env.ns, MANUAL))
    await env.run_pass()
    env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    await env.pass_after(31)  # the polling pool's next poll sees the job
    await manual.reconcile((env.ns, MANUAL))
    st = (await env.kube.get(ImpVMRunnerPoolResource, MANUAL, namespace=env.ns)).to_dict()
    assert st["status"]["pendingJobs"] == 0 and st["status"]["desired"] == 1
    assert (await env.status())["pendingJobs"] == 1, "the polling pool lost the job"


def test_routing_never_names_a_pool_that_takes_no_jobs() -> None:
    def scope(name: str, created: float, takes_jobs: bool) -> PoolScope:
        key = PoolLabels(namespace="ns", name=name, labels=("imp",), created=created, uid=name)
        return PoolScope(key=key, org="octo", installation="i", takes_jobs=takes_jobs)

    job = Job(
        id=1,
        run_id=1,
        repository="octo/app",
        labels=("self-hosted", "imp"),
        status="queued",
        seen_at=dt.datetime.now(dt.UTC),
        installation="i",
    )
    pools = [scope("manual", 1.0, False), scope("polling", 2.0, True)]
    assert [p.name for p in candidates(job, pools)] == ["polling"]
