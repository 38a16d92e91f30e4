"""A deleted pool leaves the operator's /metrics: its gauges (VMs by state, desired VMs, pending
jobs) are removed with it, read over the real HTTP endpoint, while another pool's stay."""

from __future__ import annotations

import httpx
import pytest

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.kube.controlplane import free_port
from impvm.operator import http as operator_http
from impvm.operator.pool import PoolReconciler
from tests.operator.conftest import POOL, PoolEnv

pytestmark = [pytest.mark.controlplane]

GAUGES = ("impvm_pool_vms", "impvm_pool_desired_vms", "impvm_pool_pending_jobs")


async def _series(url: str, ns: str, pool: str) -> list[str]:
    """The lines of /metrics naming the pool, of the pool gauges."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(url)).text
    label = f'namespace="{ns}",pool="{pool}"'
    return [ln for ln in text.splitlines() if ln.startswith(GAUGES) and label in ln]


async def test_a_deleted_pools_gauges_leave_metrics(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=1)
    other = "ci-pool-2"
    await env.create_pool(other)
    await env.run_pass()
    await PoolReconciler(env.ctx).reconcile((env.ns, other))
    port = free_port()
    runner = await operator_http.start(operator_http.make_app(), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        ours = await _series(url, env.ns, POOL)
        assert {ln.split("{")[0] for ln in ours} == set(GAUGES)
        await env.kube.delete(ImpVMRunnerPoolResource, POOL, namespace=env.ns)
        assert await env.run_pass() is None  # the pool's loop ends: it is gone
        assert await _series(url, env.ns, POOL) == [], "a deleted pool is still exported"
        assert await _series(url, env.ns, other), "another pool's gauges went too"
    finally:
        await runner.cleanup()
