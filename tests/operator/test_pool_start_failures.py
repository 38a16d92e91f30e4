"""One broken template must not spend the installation for everyone, pass by pass against the
real API server and the GitHub stand-in (the VMs' agent is played by the test: each VM the
broken pool makes fails at start, its runner never online, as a runner that exits at once does):

- after n such VMs in a row the next waits 5 s * 2**(n-1) after the last one ended (at most
  300 s), so JIT mints stay bounded; condition ``TemplateFailing`` names the template and the
  last exit reason;
- another pool of the same installation keeps getting its VMs meanwhile;
- a template edit (its hash changes) ends the backoff: the pool makes a VM at once;
- no pool mints more than its share of the installation's JIT budget (GitHub's secondary rate
  limit: about 80 content-creating requests a minute)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from lightkube.types import PatchType

from impvm.api.resources import ImpVMResource, ImpVMTemplateResource
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.pool import PoolReconciler
from impvm.scaling.names import runner_prefix
from impvm.scaling.settings import PassSettings
from tests.operator.conftest import JIT_PATH, POOL, RUNNER_LAYER, TEMPLATE, PoolEnv

pytestmark = [pytest.mark.controlplane]

GOOD = "good-pool"
FIXED_LAYER = "registry.example/imp/runner-layer@sha256:" + "8" * 64


async def _fail_new_vms(env: PoolEnv, pool: str, at: dt.datetime) -> int:
    """Every VM of ``pool`` not yet ended fails at start at ``at`` (its runner exited 1 before
    it came online), as its agent reports it. Returns how many."""
    n = 0
    for vm in await env.vms():
        if vm["metadata"]["labels"]["imp.dev/runner-pool"] != pool:
            continue
        if (vm.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            continue
        status = {
            "phase": "Failed",
            "exitReason": "Error",
            "exitCode": 1,
            "finishedAt": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        await env.kube.patch(
            ImpVMResource.Status,
            vm["metadata"]["name"],
            {"status": status},
            namespace=env.ns,
            patch_type=PatchType.MERGE,
        )
        n += 1
    return n


async def test_a_failing_template_backs_its_pool_off_and_a_fix_recovers_at_once(
    env: PoolEnv,
) -> None:
    await env.ready_pool(minIdle=1, maxConcurrent=5, scaleUpStep=5, cooldownSeconds=0)
    good = await env.create_pool(GOOD, minIdle=2, maxConcurrent=5, scaleUpStep=1)
    good_prefix = runner_prefix(GOOD, good["metadata"]["uid"])
    broken = PoolReconciler(env.ctx)
    healthy = PoolReconciler(env.ctx)
    failures = 0
    for _ in range(31):  # a pass every 2 s for a minute; each new VM fails at once
        await broken.reconcile((env.ns, POOL))
        await healthy.reconcile((env.ns, GOOD))
        failures += await _fail_new_vms(env, POOL, env.ctx.clock.now())
        env.clock.advance(2)
    # made at 0 s, then 5, 10, 20 s after each failure: at 0, 6, 16 and 36 s
    assert failures <= 5, f"{failures} VMs of a failing template in 60 s"
    cond = (await env.conditions())["TemplateFailing"]
    assert (cond["status"], cond["reason"]) == ("True", "Error")
    assert f"template {TEMPLATE!r}" in cond["message"] and "exit code 1" in cond["message"]
    await env.collect()
    assert env.events_with("TemplateFailing")
    # the other pool of the installation got its VMs meanwhile (scaleUpStep 1: one a pass)
    good_vms = [v for v in await env.vms() if v["metadata"]["name"].startswith(good_prefix)]
    assert len(good_vms) == 2

    # the template is fixed (another runner layer): a VM at once, the backoff is over
    await env.kube.patch(
        ImpVMTemplateResource,
        TEMPLATE,
        {"spec": {"runnerLayer": FIXED_LAYER}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )
    env.clock.advance(0.5)
    await broken.reconcile((env.ns, POOL))
    fresh = [
        v
        for v in await env.vms()
        if v["metadata"]["labels"]["imp.dev/runner-pool"] == POOL
        and v["spec"].get("runnerLayer") == FIXED_LAYER
    ]
    assert len(fresh) == 1, "the fixed template waited for the old backoff"
    assert RUNNER_LAYER != FIXED_LAYER


async def test_no_pool_mints_more_than_its_share_of_the_installation(env: PoolEnv) -> None:
    """An installation allowed 8 JIT configs a minute, two pools: the one that wants 10 VMs
    gets its share (4) this minute and the rest the next; the other pool still gets its 2."""
    pool = PassSettings(installation_mints_per_minute=8, pool_mint_share=0.5)
    settings = OperatorSettings(
        pool=pool, github_api_url=env.standin.url, github_retry=env.ctx.settings.github_retry
    )
    ctx = OperatorContext(env.ctx.kube, settings, clock=env.clock)
    try:
        await env.ready_pool(minIdle=10, maxConcurrent=10, scaleUpStep=10)
        await env.create_pool(GOOD, minIdle=2, maxConcurrent=5, scaleUpStep=5)
        big, small = PoolReconciler(ctx), PoolReconciler(ctx)
        await small.reconcile((env.ns, GOOD))
        await big.reconcile((env.ns, POOL))
        counts = _by_pool(await env.vms())
        assert counts == {GOOD: 2, POOL: 4}, counts
        await big.reconcile((env.ns, POOL))
        assert _by_pool(await env.vms())[POOL] == 4  # the share of this minute is spent
        ready = (await env.conditions())["Ready"]
        assert "JIT mint budget" in ready["message"]
        env.clock.advance(61)
        await big.reconcile((env.ns, POOL))
        assert _by_pool(await env.vms())[POOL] == 8
        assert len(env.requests("POST", JIT_PATH)) == 10
    finally:
        await ctx.close()


def _by_pool(vms: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in vms:
        p = v["metadata"]["labels"]["imp.dev/runner-pool"]
        out[p] = out.get(p, 0) + 1
    return out
