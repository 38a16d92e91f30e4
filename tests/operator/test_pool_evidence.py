"""A runner that took its job is busy, whoever said so first: the pool controller against the
real API server, the GitHub stand-in over real HTTP and its signed webhook deliveries into the
operator's webhook receiver, one pass at a time with the operator's clock moved by the test.

GitHub's runner list lags behind the job's own record: a short job can be taken, run and
finished between two lists. The job's record (a webhook delivery, a poll) names its runner and
when it started; each test here is a case where only that record tells."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.api.models import POOL_LABEL
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.seed import REPO, example_scaling, pool_manifest
from impvm.devstack.standin_runner import decode_jitconfig
from impvm.kube.controlplane import free_port
from impvm.operator.pool import PoolReconciler
from impvm.operator.webhooks import WebhookReceiver
from tests.operator.conftest import JIT_PATH, RUNNER_PATH, TEMPLATE, PoolEnv

pytestmark = [pytest.mark.controlplane]

LABELS = ["self-hosted", "imp"]
HOOK = "hook"


@contextlib.asynccontextmanager
async def deliveries(env: PoolEnv) -> AsyncIterator[None]:
    """The operator's webhook receiver on loopback, the webhook Secret the pool names, and the
    stand-in delivering signed ``workflow_job`` webhooks to the receiver."""
    secret = uuid.uuid4().hex
    data = {"webhook_secret": base64.b64encode(secret.encode()).decode()}
    await env.kube.create(Secret(metadata=ObjectMeta(name=HOOK, namespace=env.ns), data=data))
    app = web.Application()
    app.router.add_post("/webhooks/github", WebhookReceiver(env.ctx).handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    env.standin.add_webhook(f"http://127.0.0.1:{port}/webhooks/github", secret)
    try:
        yield
    finally:
        env.standin.state.webhooks.clear()
        await runner.cleanup()


async def until(what: str, check: Callable[[], bool], seconds: float = 20.0) -> None:
    """Wait (bounded) until ``check()`` holds: deliveries arrive asynchronously."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def open_jobs(env: PoolEnv) -> dict[int, Any]:
    """The open jobs of every installation's job table, by id."""
    return {i: j for t in env.ctx.jobs.tables.values() for i, j in t.jobs.items()}


def mints(env: PoolEnv) -> int:
    return sum(1 for r in env.requests("POST", JIT_PATH) if r.get("status") == 201)


async def report_phase(env: PoolEnv, vm: dict[str, Any], phase: str) -> None:
    """Write the VM's phase as its agent would."""
    await env.kube.patch(
        ImpVMResource.Status,
        vm["metadata"]["name"],
        {"status": {"phase": phase}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )


async def run_job(env: PoolEnv, vm: dict[str, Any]) -> int:
    """The VM's runner takes a job, runs it and leaves (an ephemeral runner's registration goes
    with its session): what a stand-in runner in the guest does. Returns the job id."""
    taken = await env.runner_call(vm, "/acquire", {"wait": 0})
    job_id = int(taken.json()["job"]["id"])
    await env.runner_call(vm, f"/jobs/{job_id}/complete", {"conclusion": "success"})
    await end_session(env, vm)
    return job_id


async def end_session(env: PoolEnv, vm: dict[str, Any]) -> None:
    """The runner's session ends (it exits after its one job)."""
    settings, token = decode_jitconfig(await env.jit_of(vm))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        resp = await http.delete(str(settings["serverUrl"]).rstrip("/") + "/session")
    resp.raise_for_status()


async def test_a_runner_that_just_took_its_job_is_busy_not_surplus(env: PoolEnv) -> None:
    """A burst of 6 jobs at maxConcurrent 6, cooldown 0: one runner takes its job and the
    ``in_progress`` delivery arrives before GitHub's runner list shows the runner busy. The job
    record names the runner: it is busy, so 5 queued jobs plus 1 busy runner still need all 6
    VMs. Before, the pass saw 6 idle runners for 5 queued jobs and scaled one down (a VM made
    again later: an extra JIT mint), or asked GitHub to delete the busy runner (422)."""
    await env.ready_pool(
        mode="hybrid",
        webhook={"secretRef": {"name": HOOK}},
        minIdle=0,
        maxConcurrent=6,
        scaleUpStep=6,
        cooldownSeconds=0,
    )
    async with deliveries(env):
        await env.run_pass()  # registers the pool's webhook secret; nothing queued yet
        for i in range(6):
            env.standin.queue_job(REPO, LABELS, name=f"burst-{i}", sleep_seconds=2)
        await until("6 queued jobs in the job table", lambda: len(open_jobs(env)) == 6)
        await env.pass_after(1)
        vms = await env.vms()
        assert len(vms) == 6 and mints(env) == 6
        await env.bring_online()
        await env.pass_after(1)  # a fresh runner list: 6 runners online, idle

        first = vms[0]
        taken = await env.runner_call(first, "/acquire", {"wait": 0})
        job_id = int(taken.json()["job"]["id"])
        await until(
            "the in_progress delivery",
            lambda: open_jobs(env)[job_id].status == "in_progress",
        )
        await env.run_pass()  # at once: the last runner list still shows the runner idle
        assert len(await env.vms()) == 6, "a VM was scaled down while 5 jobs were queued"
        assert env.requests("DELETE", RUNNER_PATH) == []
        assert env.events_with("VMDeleted") == [] and env.events_with("ScaleDownSkipped") == []
        st = await env.status()
        assert (st["busy"], st["pendingJobs"], st["desired"]) == (1, 5, 6)

        # every job runs on the VMs made for the burst, and each VM goes once its job is done
        await env.runner_call(first, f"/jobs/{job_id}/complete", {"conclusion": "success"})
        await end_session(env, first)
        for vm in vms[1:]:
            await run_job(env, vm)
        await until("every job completed", lambda: not open_jobs(env))
        for vm in vms:
            await report_phase(env, vm, "Succeeded")
        await env.pass_after(1)
        await env.pass_after(1)
        assert await env.vms() == []
    assert mints(env) == 6, "one JIT config per job (minIdle 0)"
    refused = [r for r in env.requests("DELETE", RUNNER_PATH) if r.get("status") == 422]
    assert refused == [], "a deregistration of a busy runner was asked for"


async def test_a_short_jobs_vm_is_not_replaced_after_its_job(env: PoolEnv) -> None:
    """A polling pool at minIdle 0 and one short job: the runner registers, takes the job, runs
    it and is gone (GitHub removes an ephemeral runner) before any runner list showed it busy,
    and before the agent reported the VM Succeeded. Its registration vanished, but the job is
    not queued any more: the VM did its job and is not replaced. Before, the pass took the
    vanished registration for a broken VM and replaced it (2 VMs and 2 JIT mints for one
    job; the replacement then idled until the cooldown removed it)."""
    await env.ready_pool(minIdle=0, maxConcurrent=2, scaleUpStep=2, cooldownSeconds=30)
    env.standin.state.queue_job(REPO, LABELS)
    await env.run_pass()  # the first poll sees the job queued: one VM for it
    (vm,) = await env.vms()
    await report_phase(env, vm, "Running")
    await env.runner_call(vm, "/session")
    await run_job(env, vm)
    assert env.runners_named(vm["metadata"]["name"]) == []

    seen: set[str] = set()
    await env.pass_after(2)  # woken by the VM's phase, long before the next poll is due
    seen |= {v["metadata"]["name"] for v in await env.vms()}
    for _ in range(3):
        await env.pass_after(31)
        seen |= {v["metadata"]["name"] for v in await env.vms()}
    assert seen <= {vm["metadata"]["name"]}, "a replacement VM was made for a finished job"
    assert mints(env) == 1


async def test_a_short_jobs_completed_delivery_ends_its_vm_without_a_replacement(
    env: PoolEnv,
) -> None:
    """The same short job in webhook mode: the ``in_progress`` and ``completed`` deliveries name
    the runner, so the pass knows the VM's job is done without polling, and makes no new VM."""
    await env.ready_pool(mode="webhook", webhook={"secretRef": {"name": HOOK}}, minIdle=0)
    async with deliveries(env):
        await env.run_pass()
        env.standin.queue_job(REPO, LABELS, name="short")
        await until("the queued delivery", lambda: len(open_jobs(env)) == 1)
        await env.pass_after(1)
        (vm,) = await env.vms()
        await report_phase(env, vm, "Running")
        await env.runner_call(vm, "/session")
        await run_job(env, vm)
        await until("the completed delivery", lambda: not open_jobs(env))
        polls = len(env.requests("GET", "/repos/{owner}/{repo}/actions/runs"))
        await env.pass_after(2)
        names = {v["metadata"]["name"] for v in await env.vms()}
        assert names <= {vm["metadata"]["name"]}, "a replacement VM was made for a finished job"
        assert len(env.requests("GET", "/repos/{owner}/{repo}/actions/runs")) == polls
        assert mints(env) == 1


async def test_a_job_started_on_a_runner_never_listed_online_is_its_time_to_ready(
    env: PoolEnv,
) -> None:
    """An adaptive warm pool in webhook mode: a short job's runner comes online, takes the job
    and finishes between two passes, so no runner list ever shows it online. The job's
    ``in_progress`` delivery names the runner and its start: that start is the runner's
    readiness, one time-to-ready sample. Before, such a runner gave none, and a pool of short
    jobs never learnt its time to ready."""
    warm = {"mode": "adaptive", "maxIdle": 3, "arrivalHalfLifeSeconds": 60}
    await env.ready_pool(
        mode="webhook",
        webhook={"secretRef": {"name": HOOK}},
        minIdle=0,
        cooldownSeconds=0,
        warmPool=warm,
    )
    async with deliveries(env):
        await env.run_pass()
        env.standin.queue_job(REPO, LABELS, name="short")
        await until("the queued delivery", lambda: len(open_jobs(env)) == 1)
        await env.pass_after(1)
        (vm,) = await env.vms()
        await env.runner_call(vm, "/session")
        await run_job(env, vm)
        await until("the completed delivery", lambda: not open_jobs(env))
        await env.pass_after(5)
        st = (await env.status())["warmPool"]
        assert st.get("readySamples") == 1
        assert 0 <= st["readySeconds"] <= 30


async def test_a_pool_created_after_its_jobs_delivery_still_runs_it(env: PoolEnv) -> None:
    """A webhook pool is created, and a job for its labels is queued and delivered before the
    operator's first pass of the new pool: the delivery's verifiers were the pools known then
    (the older pool only, which cannot run it), so only GitHub's own read can show the new pool
    its job. Its first pass polls again (the poll the older pool made started before the new
    pool's route was published) and makes a VM for the job. Before, the new pool's first pass
    reused the older poll and the job waited for the safety poll (5 minutes)."""
    await env.ready_pool(mode="webhook", webhook={"secretRef": {"name": HOOK}}, minIdle=0)
    async with deliveries(env):
        await env.run_pass()  # the older pool's first poll; its webhook secret is known
        late = "late-pool"
        labels = ["self-hosted", "late"]
        scaling = {
            **example_scaling(),
            "mode": "webhook",
            "webhook": {"secretRef": {"name": HOOK}},
            "minIdle": 0,
        }
        body = pool_manifest(late, env.ns, scaling, labels=labels, template=TEMPLATE)
        await env.kube.create(ImpVMRunnerPoolResource.from_dict(body))
        env.standin.queue_job(REPO, labels, name="early")
        answered = lambda: [d.status for d in env.standin.state.deliveries]  # noqa: E731
        await until("the delivery answered", lambda: answered() == [202])
        assert open_jobs(env) == {}  # its only verifier cannot run it: recorded nowhere
        env.clock.advance(1)
        await PoolReconciler(env.ctx).reconcile((env.ns, late))
        await env.collect()
        mine = [v for v in await env.vms() if v["metadata"]["labels"].get(POOL_LABEL) == late]
        assert len(mine) == 1, "the new pool made no VM for the job queued before its first pass"
