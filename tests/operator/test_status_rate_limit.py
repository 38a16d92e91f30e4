"""``impvm status``'s rate limit per installation, read from what the pool controller wrote on
real pools (real API server, the GitHub stand-in counting the installation's requests): two
credentials Secrets naming one App installation are one row, and a pool whose status is rarely
written (switched to manual) cannot make it show an old value."""

from __future__ import annotations

import pytest
from lightkube.types import PatchType

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.commands.status import read_snapshot
from impvm.commands.statusview import summarize
from impvm.devstack.seed import APP_ID, INSTALLATION_ID, REPO, app_secret
from impvm.operator.pool import PoolReconciler
from tests.operator.conftest import POOL, PoolEnv

pytestmark = [pytest.mark.controlplane]

OTHER = "ci-pool-2"


async def test_one_installation_is_one_row_with_its_newest_limit(env: PoolEnv) -> None:
    await env.ready_pool()  # polling, credentials "github-runner-app"
    await env.kube.create(app_secret("creds-2", env.ns, APP_ID, INSTALLATION_ID, env.private_key))
    await env.create_pool(OTHER)
    await env.kube.patch(
        ImpVMRunnerPoolResource,
        OTHER,
        # other labels: the jobs queued below are the first pool's (routing ties go to the
        # older pool, and both were made in the same second)
        {"spec": {"platform": {"credentialsSecret": "creds-2"}, "labels": ["self-hosted", "two"]}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )
    other = PoolReconciler(env.ctx)
    await env.run_pass()
    await other.reconcile((env.ns, OTHER))
    # the second pool is switched to manual: its status is written only when something changes
    await env.kube.patch(
        ImpVMRunnerPoolResource,
        OTHER,
        {"spec": {"scaling": {"mode": "manual", "polling": None}}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )
    await other.reconcile((env.ns, OTHER))
    # the first pool goes on polling: the installation's requests are counted down
    for _ in range(3):
        env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
        await env.pass_after(31)
        await other.reconcile((env.ns, OTHER))
    doc = summarize(await read_snapshot(env.kube, env.ns))
    rows = doc["rateLimits"]
    assert len(rows) == 1, f"one installation shown as {len(rows)} rows: {rows}"
    (row,) = rows
    assert sorted(row["pools"]) == sorted([POOL, OTHER])
    current = (await env.status())["rateLimit"]
    assert row["remaining"] == current["remaining"], "an older value of the installation shown"
    frozen = (await env.kube.get(ImpVMRunnerPoolResource, OTHER, namespace=env.ns)).to_dict()
    assert frozen["status"]["rateLimit"]["remaining"] > current["remaining"]
