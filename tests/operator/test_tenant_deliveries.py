"""Webhook deliveries move only their own pools' jobs, and routing stays within one
installation: attacks by a tenant holding its own App, webhook secret and pool, against another
tenant's jobs and runners, through the real webhook receiver (HTTP), the real API server and the
GitHub stand-in (which hosts both Apps and their installations).

- a ``completed`` delivery for the other tenant's queued job does not take it away, and the next
  poll is not refused (only GitHub's own reads end a job);
- an ``in_progress`` delivery naming the other tenant's runner attaches nothing to its VM, so the
  reaper never judges that VM by a foreign run;
- a job polled through one installation is never routed to a pool of another, however its
  namespace is named; between pools of the same installation the oldest pool wins a tie;
- a flood of forged deliveries evicts only the flooder's own entries from the bounded table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from prometheus_client import REGISTRY

from impvm.api.models import ImpVMRunnerPool
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.standin import StandIn
from impvm.github import RetryPolicy
from impvm.kube.controlplane import ControlPlane, free_port
from impvm.operator import http as operator_http
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.credentials import GitHubProvider
from impvm.operator.reaper import reap_pool
from impvm.operator.webhooks import WebhookReceiver
from impvm.scaling.jobs import route
from tests.operator.conftest import FakeClock
from tests.tenants import POOL, Tenant, deliver, seed_app, signed, tenant

pytestmark = [pytest.mark.controlplane]


@dataclass
class World:
    kube: AsyncClient
    standin: StandIn
    ctx: OperatorContext
    clock: FakeClock
    url: str
    victim: Tenant
    attacker: Tenant

    async def poll_both(self) -> None:
        """Both pools' next passes, with their polls due."""
        self.clock.advance(31)
        await self.victim.run_pass(self.ctx)
        await self.attacker.run_pass(self.ctx)


@pytest.fixture
async def w(control_plane: ControlPlane, caplog: pytest.LogCaptureFixture) -> AsyncIterator[World]:
    caplog.set_level(logging.INFO, logger="impvm")
    kubeconfig = KubeConfig.from_file(str(control_plane.kubeconfig))
    admin = AsyncClient(config=kubeconfig, field_manager="test")
    operator = AsyncClient(config=kubeconfig, field_manager="impvm-operator")
    standin = StandIn()
    await standin.start()
    victim = tenant("z-victim", 32001, 42001, "victim-org")
    attacker = tenant("a-attacker", 32002, 42002, "attacker-org")
    seed_app(standin, victim)
    seed_app(standin, attacker)
    clock = FakeClock()
    settings = OperatorSettings(
        github_api_url=standin.url, github_retry=RetryPolicy(max_transient_retries=0)
    )
    ctx = OperatorContext(operator, settings, clock=clock)
    port = free_port()
    runner = await operator_http.start(
        operator_http.make_app(WebhookReceiver(ctx).handle), "127.0.0.1", port
    )
    url = f"http://127.0.0.1:{port}/webhooks/github"
    # each App's webhook reaches the operator with that App's secret
    standin.add_webhook(url, victim.webhook_secret, app_id=victim.app_id)
    standin.add_webhook(url, attacker.webhook_secret, app_id=attacker.app_id)
    try:
        yield World(admin, standin, ctx, clock, url, victim, attacker)
    finally:
        await runner.cleanup()
        await ctx.close()
        for t in (victim, attacker):
            await t.delete(admin)
        await standin.stop()
        await operator.close()
        await admin.close()


async def both_pools(w: World, min_idle: int = 0) -> None:
    await w.victim.create(w.kube, min_idle=min_idle)
    await w.attacker.create(w.kube, min_idle=min_idle)
    await w.victim.run_pass(w.ctx)
    await w.attacker.run_pass(w.ctx)


async def settled(standin: StandIn, count: int) -> None:
    """Wait until the stand-in made ``count`` deliveries in all and each was answered."""
    for _ in range(600):
        done = [d for d in standin.state.deliveries if d.status is not None or d.error]
        if len(done) >= count:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the stand-in's {count} deliveries were not answered")


async def test_a_completed_delivery_does_not_take_away_another_tenants_job(w: World) -> None:
    await both_pools(w)
    job = w.standin.queue_job(w.victim.repo, ["self-hosted", "imp"])  # the victim's App tells
    await settled(w.standin, 1)
    assert w.victim.pending(w.ctx) == 1
    # the attacker signs "completed" for the victim's job, naming either installation
    forged = [
        signed(w.standin, w.attacker.webhook_secret, "completed", job, inst)
        for inst in (w.victim.installation_id, w.attacker.installation_id, None)
    ]
    assert set(await deliver(w.url, forged)) <= {200, 202}  # answered, and nothing moved
    assert w.victim.pending(w.ctx) == 1
    await w.poll_both()  # GitHub still lists the job queued: the poll keeps it
    table = w.victim.table(w.ctx)
    assert table is not None and table.jobs[job.id].status == "queued"
    assert w.victim.pending(w.ctx) == 1 and w.attacker.pending(w.ctx) == 0
    assert len(await w.victim.vms(w.kube)) == 1  # a VM for it
    # its own App's "completed" takes it out of demand; GitHub's next read confirms it
    w.standin.state.jobs[job.id].status = "completed"
    own = signed(w.standin, w.victim.webhook_secret, "completed", job, w.victim.installation_id)
    assert await deliver(w.url, [own]) == [202]
    assert w.victim.pending(w.ctx) == 0


async def test_an_in_progress_delivery_naming_another_tenants_runner_attaches_nothing(
    w: World,
) -> None:
    await both_pools(w, min_idle=1)
    (victim_vm,) = await w.victim.vms(w.kube)
    runner = victim_vm["metadata"]["name"]  # the victim's runner is named after its VM
    # a run of the attacker's own, "taken" by the victim's runner, then finished
    job = w.standin.state.queue_job(w.attacker.repo, ["self-hosted", "imp"])
    started = signed(
        w.standin,
        w.attacker.webhook_secret,
        "in_progress",
        job,
        w.attacker.installation_id,
        status="in_progress",
        runner_name=runner,
        started_at="2026-01-01T00:00:00Z",
    )
    assert await deliver(w.url, [started]) == [202]
    await w.victim.run_pass(w.ctx)
    await w.attacker.run_pass(w.ctx)
    vm = (await w.kube.get(ImpVMResource, runner, namespace=w.victim.ns)).to_dict()
    assert "job" not in (vm.get("status") or {})  # no foreign run on the victim's VM
    for t in (w.victim, w.attacker):
        table = t.table(w.ctx)
        assert table is None or table.running_on([runner]) == {}
    # the foreign run completes; the victim's reaper judges its VM by GitHub alone
    run = w.standin.state.runs[job.run_id]
    run.status, run.conclusion = "completed", "success"
    pool = await w.victim.pool(w.kube)
    pool["spec"]["reaper"] = {"enabled": True, "intervalSeconds": 60}
    platform = ImpVMRunnerPool.model_validate(pool).spec.platform
    provider = GitHubProvider(w.kube, api_url=w.standin.url)
    try:
        client = await provider.client(w.victim.ns, platform)
        await reap_pool(w.kube, client, pool, w.ctx.clock.now(), deregister=client)
    finally:
        await provider.close()
    assert [v["metadata"]["name"] for v in await w.victim.vms(w.kube)] == [runner]


async def test_a_job_is_routed_only_within_its_installation(w: World) -> None:
    """The attacker's pool registers in the victim's organisation (its own App cannot: that is
    its business) with the same labels and a namespace that sorts first; the victim's jobs,
    polled through the victim's installation, go to the victim only."""
    await w.victim.create(w.kube, mode="polling")
    await w.attacker.create(w.kube, mode="polling", scope_org=w.victim.org)
    await w.victim.run_pass(w.ctx)
    await w.attacker.run_pass(w.ctx)
    jobs = [w.standin.state.queue_job(w.victim.repo, ["self-hosted", "imp"]) for _ in range(3)]
    await w.poll_both()
    assert w.victim.pending(w.ctx) == 3 and w.attacker.pending(w.ctx) == 0
    table = w.victim.table(w.ctx)
    assert table is not None
    assert {route(table.jobs[j.id], w.ctx.scopes()) for j in jobs} == {
        w.ctx.pool((w.victim.ns, POOL)).scope.key  # type: ignore[union-attr]
    }
    assert w.attacker.table(w.ctx) is not table


async def a_second_later(w: World) -> None:
    """Wait (bounded) until the API server's clock is past the second the victim's pool was
    created in."""
    body = await w.kube.get(ImpVMRunnerPoolResource, POOL, namespace=w.victim.ns)
    created = body.metadata.creationTimestamp  # type: ignore[union-attr]
    assert created is not None
    deadline = time.time() + 10
    while time.time() < created.timestamp() + 1.05:
        assert time.time() < deadline, "the clock did not move past the pool's creation"
        await asyncio.sleep(0.05)


async def test_between_pools_of_one_installation_the_oldest_wins_a_tie(w: World) -> None:
    """Both teams hold keys of the same App (an organisation shares its App); the attacker's
    pool comes later, in a namespace that sorts first: ties go to the pool that was first."""
    second = w.attacker.key
    w.standin.state.add_app_key(w.victim.app_id, second)  # a second real key of the same App
    await w.victim.create(w.kube, mode="polling")
    await a_second_later(w)  # creationTimestamp has whole seconds: "later" must show in it
    await w.attacker.create(
        w.kube,
        mode="polling",
        app_id=w.victim.app_id,
        installation_id=w.victim.installation_id,
        key=second,
        scope_org=w.victim.org,
    )
    await w.victim.run_pass(w.ctx)
    await w.attacker.run_pass(w.ctx)
    ties = REGISTRY.get_sample_value("impvm_job_routing_ties_total") or 0.0
    w.standin.state.queue_job(w.victim.repo, ["self-hosted", "imp"])
    await w.poll_both()
    assert w.victim.pending(w.ctx) == 1 and w.attacker.pending(w.ctx) == 0
    assert REGISTRY.get_sample_value("impvm_job_routing_ties_total") == ties + 1


async def test_a_flood_of_forged_deliveries_evicts_only_the_flooders_jobs(w: World) -> None:
    """The same App in both namespaces (so the deliveries land in the same table); the
    attacker signs 5,100 distinct queued jobs with its own secret: more than a table keeps
    for one origin."""
    second = w.attacker.key
    w.standin.state.add_app_key(w.victim.app_id, second)
    await w.victim.create(w.kube)
    await w.attacker.create(
        w.kube,
        app_id=w.victim.app_id,
        installation_id=w.victim.installation_id,
        key=second,
        scope_org=w.victim.org,
    )
    await w.victim.run_pass(w.ctx)
    await w.attacker.run_pass(w.ctx)
    polled = w.standin.state.queue_job(w.victim.repo, ["self-hosted", "imp"])
    await w.poll_both()
    table = w.victim.table(w.ctx)
    assert table is not None and w.attacker.table(w.ctx) is table
    assert polled.id in table.jobs
    template = w.standin.queue_job(w.victim.repo, ["self-hosted", "imp"])
    await settled(w.standin, 1)  # the victim's App delivered it
    assert template.id in table.jobs
    flood = int(os.environ.get("FLOOD", "5100"))

    def forged(i: int) -> tuple[bytes, dict[str, str]]:
        return signed(
            w.standin,
            w.attacker.webhook_secret,
            "queued",
            template,
            w.victim.installation_id,
            id=10_000_000 + i,
        )

    async with httpx.AsyncClient(timeout=60) as http:
        for start in range(0, flood, 32):
            batch = [forged(i) for i in range(start, min(flood, start + 32))]
            answers = await asyncio.gather(
                *(http.post(w.url, content=body, headers=headers) for body, headers in batch)
            )
            assert {a.status_code for a in answers} == {202}
    flooded = [j for j in table.jobs.values() if j.allowed == frozenset({(w.attacker.ns, POOL)})]
    assert len(flooded) <= getattr(table, "max_jobs", 5000)
    assert polled.id in table.jobs and template.id in table.jobs  # the victim's are all kept
    assert table.jobs[template.id].allowed is None or (w.victim.ns, POOL) in (
        table.jobs[template.id].allowed or ()
    )
