"""Passes converge, carried out by the real executor: against the real API server and the GitHub
stand-in, pools of arbitrary limits and demand are driven through what their VMs' agents and
runners do (runners online, jobs taken and finished, VMs succeeding or failing, a JIT Secret
lost in a crash, a registration GitHub forgot), and then passed over at one clock reading: within
a bounded number of passes a pass does nothing (no act, no status write, no Event), and stays
so. No VM is given a second JIT config, and no pass both mints for a VM and deletes it.

Worlds are drawn from a seeded generator (one seed, one world): each is a real namespace's worth
of objects, so a few dozen of them keep the run short."""

from __future__ import annotations

import random
from typing import Any

import pytest
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.api.models import POOL_LABEL
from impvm.api.resources import ImpVMResource
from impvm.devstack.seed import REPO
from impvm.operator.context import OperatorContext
from impvm.operator.pool import PoolReconciler
from tests.operator.conftest import FakeClock, PoolEnv, operator_context

pytestmark = [pytest.mark.controlplane]

WORLDS = 16
LABELS = ["self-hosted", "imp"]


async def _phase(env: PoolEnv, vm: dict[str, Any], phase: str) -> None:
    await env.kube.patch(
        ImpVMResource.Status,
        vm["metadata"]["name"],
        {"status": {"phase": phase}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )


async def _vms(env: PoolEnv, pool: str) -> list[dict[str, Any]]:
    return [v for v in await env.vms() if v["metadata"]["labels"][POOL_LABEL] == pool]


async def _what_happens(env: PoolEnv, pool: str, rnd: random.Random) -> None:
    """What agents, runners and GitHub do to the pool's VMs between two passes, at random."""
    secrets = await env.secret_names()
    for vm in await _vms(env, pool):
        if vm["spec"].get("runnerConfigSecret") not in secrets:
            continue  # not minted yet, or its Secret is lost: its runner cannot start
        roll = rnd.random()
        name = vm["metadata"]["name"]
        if roll < 0.15:  # its runner exits (after its job, if it took one): the VM ends
            for r in env.runners_named(name):
                if r.job_id is not None and r.busy:
                    body = {"conclusion": "success"}
                    await env.runner_call(vm, f"/jobs/{r.job_id}/complete", body)
                env.standin.state.runners.pop(r.id, None)  # an ephemeral runner leaves
            await _phase(env, vm, rnd.choice(["Succeeded", "Failed"]))
        elif roll < 0.5:
            fresh = [r for r in env.runners_named(name) if r.job_id is None]
            if not fresh:
                continue  # its runner is gone or took its one job already
            await env.runner_call(vm, "/session")
            await _phase(env, vm, "Running")
            if rnd.random() < 0.5:
                await env.runner_call(vm, "/acquire", {"wait": 0})
        elif roll < 0.6:  # a crash lost the VM's Secret (the VM still names it)
            await env.kube.delete(Secret, vm["spec"]["runnerConfigSecret"], namespace=env.ns)
        elif roll < 0.65:  # GitHub forgot the registration
            for r in env.runners_named(name):
                env.standin.state.runners.pop(r.id, None)


async def test_passes_converge_and_never_mint_twice(env: PoolEnv) -> None:
    await env.create_class_and_template()
    await env.create_credentials()
    for seed in range(WORLDS):
        rnd = random.Random(seed)
        name = f"fix-{seed}"
        scaling = {
            "minIdle": rnd.randint(0, 3),
            "maxConcurrent": rnd.randint(0, 6),
            "scaleUpStep": rnd.randint(1, 3),
            "cooldownSeconds": rnd.choice([0, 30, 300]),
        }
        scaling["minIdle"] = min(scaling["minIdle"], scaling["maxConcurrent"])
        await env.create_pool(name, **scaling)
        for _ in range(rnd.randint(0, 3)):
            env.standin.state.queue_job(REPO, LABELS)
        # a fresh operator (memory, clock) per world: the VMs' creation times are the API
        # server's, so the operator's clock runs ahead only by what this world advances it
        clock = FakeClock()
        ctx = operator_context(env.ctx.kube, env.standin, clock)
        try:
            await _world(env, ctx, clock, name, seed, scaling, rnd)
        finally:
            await ctx.github.close()


async def _world(
    env: PoolEnv,
    ctx: OperatorContext,
    clock: FakeClock,
    pool: str,
    seed: int,
    scaling: dict[str, int],
    rnd: random.Random,
) -> None:
    reconciler = PoolReconciler(ctx)
    for _ in range(rnd.randint(1, 3)):  # the pool lives a little (within the bootstrap timeout)
        clock.advance(rnd.choice([1, 31, 61]))
        await reconciler.reconcile((env.ns, pool))
        await _what_happens(env, pool, rnd)
    # then the clock stands still: the passes must settle
    for _ in range(12):
        had = await _with_secret(env, pool)
        await reconciler.reconcile((env.ns, pool))
        assert reconciler.last is not None
        acts, end = reconciler.last
        minted = {m.vm for m in acts.mints if not m.record_only}
        assert not minted & had, f"world {seed}: a VM that has its Secret minted again"
        assert not minted & {d.name for d in acts.deletions}, f"world {seed}"
        if acts.count == 0 and not end.write and not end.events:
            break
    else:
        raise AssertionError(f"world {seed} {scaling}: no fixpoint")
    await reconciler.reconcile((env.ns, pool))
    assert reconciler.last is not None
    acts, end = reconciler.last
    assert acts.count == 0 and not end.write and not end.events, f"world {seed}"


async def _with_secret(env: PoolEnv, pool: str) -> set[str]:
    """The pool's VMs whose JIT Secret exists."""
    secrets = await env.secret_names()
    return {
        v["metadata"]["name"]
        for v in await _vms(env, pool)
        if v["spec"].get("runnerConfigSecret") in secrets
    }
