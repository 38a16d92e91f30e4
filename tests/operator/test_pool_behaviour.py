"""The pool controller against the real API server and the GitHub stand-in, one pass at a time,
with the operator's clock moved by the test: agents' Leases only in their own namespace, long pool names,
rate limits that must not freeze a pass, registrations that vanish, template roll-outs, the
webhook-mode safety poll, cooldown, and jobs whose ``completed`` delivery was lost."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import uuid

import pytest
from lightkube import Client
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret
from lightkube.types import PatchType

from impvm.api.models import (
    AGENT_LEASE_LABEL,
    AGENT_LEASE_NAMESPACE,
    AGENT_LEASE_PREFIX,
    API_VERSION,
    POOL_LABEL,
    Platform,
)
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource, ImpVMTemplateResource
from impvm.devstack.seed import APP_ID, INSTALLATION_ID, REPO, app_secret
from impvm.devstack.standin.records import Failure
from impvm.github import RetryPolicy
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.pool import PoolReconciler, runner_prefix
from impvm.scaling.settings import PassSettings
from tests.operator.conftest import BASE_IMAGE, POOL, RUNNER_LAYER, TEMPLATE, PoolEnv

pytestmark = [pytest.mark.controlplane]

RUNNERS_PATH = "/orgs/{org}/actions/runners"
RUNS_PATH = "/repos/{owner}/{repo}/actions/runs"
NEW_IMAGE = "registry.example/imp/runner-base@sha256:" + "7" * 64


async def new_template_image(env: PoolEnv) -> None:
    """Point the pool's template at another image (what a user does to roll one out)."""
    patch = {"spec": {"image": NEW_IMAGE}}
    merge = PatchType.MERGE
    await env.kube.patch(ImpVMTemplateResource, TEMPLATE, patch, namespace=env.ns, patch_type=merge)


async def bound_vm(env: PoolEnv, node: str, suffix: str) -> str:
    """A VM of the pool bound to ``node`` (as an agent would have claimed it)."""
    pool = await env.pool()
    name = runner_prefix(POOL, pool["metadata"]["uid"]) + suffix
    owner = {"apiVersion": API_VERSION, "kind": "ImpVMRunnerPool", "name": POOL}
    owner |= {"uid": pool["metadata"]["uid"], "controller": True}
    meta = {"name": name, "namespace": env.ns, "labels": {POOL_LABEL: POOL}}
    spec = {"classRef": {"name": env.class_name}, "image": BASE_IMAGE, "nodeName": node}
    spec["runnerLayer"] = RUNNER_LAYER
    body = {"apiVersion": API_VERSION, "kind": "ImpVM", "metadata": meta, "spec": spec}
    body["metadata"]["ownerReferences"] = [owner]  # type: ignore[index]
    await env.kube.create(ImpVMResource.from_dict(body))
    return name


def node_lease(node: str, namespace: str) -> Lease:
    """A live agent Lease of ``node`` in ``namespace`` (what an agent renews; what a tenant
    with edit rights in ``namespace`` can make too)."""
    return Lease(
        metadata=ObjectMeta(
            name=f"{AGENT_LEASE_PREFIX}{node}",
            namespace=namespace,
            labels=dict([AGENT_LEASE_LABEL]),
        ),
        spec=LeaseSpec(
            holderIdentity=node,
            leaseDurationSeconds=40,
            renewTime=dt.datetime.now(dt.UTC),
        ),
    )


async def test_a_tenant_made_agent_lease_keeps_no_node_alive(env: PoolEnv, kube: Client) -> None:
    """Only the agents' Lease namespace holds node Leases: a Lease with the agents' label and
    name made in a tenant's namespace does not keep a dead node's VMs (they are failed
    ``NodeLost`` and replaced), while the same Lease in the agents' namespace does."""
    await env.ready_pool(minIdle=1)
    try:
        kube.create(Namespace(metadata=ObjectMeta(name=AGENT_LEASE_NAMESPACE)))
    except ApiError as e:
        if e.status.code != 409:
            raise
    suffix = uuid.uuid4().hex[:6]
    live, faked = f"node-live-{suffix}", f"node-faked-{suffix}"
    kube.create(node_lease(live, AGENT_LEASE_NAMESPACE))
    # the tenant's own namespace (the pool's): edit rights there allow creating Leases
    kube.create(node_lease(faked, env.ns))
    try:
        kept = await bound_vm(env, live, "0b0b0b")
        lost = await bound_vm(env, faked, "c0c0c0")
        await env.run_pass()
        vm = await env.vm(kept)
        assert (vm.get("status") or {}).get("exitReason") != "NodeLost"
        (ev,) = env.events_with("NodeLost")
        assert lost in ev.message and ev.type == "Warning"
        assert lost not in {v["metadata"]["name"] for v in await env.vms()}
    finally:
        kube.delete(Lease, f"{AGENT_LEASE_PREFIX}{live}", namespace=AGENT_LEASE_NAMESPACE)


async def test_a_pool_with_the_longest_name_registers_runners(env: PoolEnv) -> None:
    """A 63-character pool name (the API's limit) still gives runner names GitHub accepts
    (at most 64 characters); before, the name was 76 characters and GitHub answered 422."""
    await env.create_class_and_template()
    await env.create_credentials()
    long_name = "l" * 60 + "ong"
    await env.create_pool(long_name, minIdle=2, maxConcurrent=3, scaleUpStep=2)
    await PoolReconciler(env.ctx).reconcile((env.ns, long_name))
    vms = await env.vms()
    assert len(vms) == 2
    for vm in vms:
        name = vm["metadata"]["name"]
        assert len(name) <= 64
        (registration,) = env.runners_named(name)
        assert vm["status"]["runner"]["id"] == registration.id
    assert not [r for r in env.standin.state.requests if r.get("status") == 422]


async def test_a_rate_limit_is_reported_in_the_same_pass_without_waiting(
    env: PoolEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """A secondary rate limit without retry-after: the pass does not wait inside the request;
    RateLimited is True after that one pass, the retry is scheduled, and the idle runner is
    still reported idle while the runner list cannot be read."""
    await env.ready_pool(minIdle=1)
    await env.run_pass()
    await env.bring_online()
    await env.run_pass()
    assert (await env.status())["idle"] == 1
    env.standin.state.failures.append(
        Failure(kind="secondary_rate_limit", method="GET", path=RUNNERS_PATH, count=100)
    )
    delay = await asyncio.wait_for(env.run_pass(), 20)
    conds = await env.conditions()
    c = conds["RateLimited"]
    assert (c["status"], c["reason"]) == ("True", "SecondaryRateLimit")
    assert "resets" in c["message"]
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "RateLimited")
    s = await env.status()
    assert (s["idle"], s["starting"]) == (1, 0)
    assert delay is not None and delay <= 10
    assert len(env.requests("GET", RUNNERS_PATH)) == 3  # one each pass, no retry inside

    # during the backoff (60 s asked by GitHub's documentation): no call at all
    await env.pass_after(30)
    assert len(env.requests("GET", RUNNERS_PATH)) == 3
    env.standin.state.failures.clear()
    await env.pass_after(31)
    conds = await env.conditions()
    assert conds["RateLimited"]["status"] == "False" and conds["Ready"]["status"] == "True"
    await env.assert_no_secrets(caplog)


async def test_a_vanished_registration_marks_the_runner_offline(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=1, maxConcurrent=1)
    await env.run_pass()
    await env.bring_online()
    await env.run_pass()
    (vm,) = await env.vms()
    assert vm["status"]["runner"]["online"] is True
    env.standin.state.runners.clear()  # GitHub forgot the runner
    await env.run_pass()
    vm = await env.vm(vm["metadata"]["name"])
    assert vm["status"]["runner"]["online"] is False
    assert vm["status"]["runner"]["busy"] is False


async def test_scale_down_waits_for_the_cooldown(env: PoolEnv) -> None:
    """cooldownSeconds 30: surplus idle runners stay until 30 s after the last scale-up."""
    await env.ready_pool(minIdle=2, scaleUpStep=2, cooldownSeconds=30)
    await env.run_pass()
    await env.bring_online()
    await env.patch_scaling(minIdle=1)
    await env.pass_after(20)
    assert len(await env.vms()) == 2 and env.events_with("VMDeleted") == []
    await env.pass_after(11)
    assert len(await env.vms()) == 1
    (ev,) = env.events_with("VMDeleted")
    assert "cooldown 30s elapsed" in ev.message


async def test_a_template_edit_rolls_out_to_idle_vms(env: PoolEnv) -> None:
    """Point the template at a new image while the runners idle: the pool is woken, status
    counts the outdated VMs, replacements are made first, and an old VM goes only while
    minIdle ready runners remain; a busy one finishes its job first."""
    await env.ready_pool(minIdle=1, scaleUpStep=1, maxConcurrent=4)
    await env.run_pass()
    await env.bring_online()
    await env.run_pass()
    (old,) = await env.vms()
    assert (await env.status())["outdated"] == 0

    mem = env.ctx.pool((env.ns, POOL))
    mem.wake.clear()
    await new_template_image(env)
    env.ctx.wake_using(env.ns, TEMPLATE, None)  # what the template's watch handler calls
    assert mem.wake.is_set()

    await env.run_pass()
    s = await env.status()
    assert s["outdated"] == 1
    vms = {v["metadata"]["name"]: v for v in await env.vms()}
    assert len(vms) == 2 and old["metadata"]["name"] in vms  # the only ready runner stays
    (new,) = [v for n, v in vms.items() if n != old["metadata"]["name"]]
    assert new["spec"]["image"] == NEW_IMAGE

    await env.runner_call(new, "/session")  # the replacement comes online
    await env.run_pass()
    names = {v["metadata"]["name"] for v in await env.vms()}
    assert names == {new["metadata"]["name"]}
    await env.run_pass()
    assert (await env.status())["outdated"] == 0
    assert any("older template" in e.message for e in env.events_with("VMDeleted"))


async def test_a_busy_outdated_vm_finishes_its_job(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=1, scaleUpStep=1, maxConcurrent=4)
    await env.run_pass()
    await env.bring_online()
    (old,) = await env.vms()
    env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    await env.runner_call(old, "/acquire", {"wait": 0})
    await new_template_image(env)
    for _ in range(3):
        await env.pass_after(31)
    assert old["metadata"]["name"] in {v["metadata"]["name"] for v in await env.vms()}
    assert (await env.status())["outdated"] == 1


async def test_webhook_mode_safety_poll_period_is_a_setting(env: PoolEnv) -> None:
    await env.create_class_and_template()
    await env.create_credentials()
    await env.create_pool(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    settings = OperatorSettings(
        pool=PassSettings(webhook_safety_poll_seconds=60),
        github_api_url=env.standin.url,
        github_retry=RetryPolicy(max_transient_retries=0),
    )
    ctx = OperatorContext(env.ctx.kube, settings, clock=env.clock)
    try:
        polls = lambda: len(env.requests("GET", RUNS_PATH))  # noqa: E731
        await env.run_pass(ctx)
        first = polls()
        assert first > 0  # at start: an operator restart loses no job
        await env.pass_after(59, ctx)
        assert polls() == first
        await env.pass_after(2, ctx)
        assert polls() > first
    finally:
        await ctx.close()


async def test_a_job_whose_completed_delivery_was_lost_is_not_kept_in_progress(
    env: PoolEnv,
) -> None:
    await env.ready_pool(minIdle=1)
    await env.run_pass()
    await env.bring_online()
    job = env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    (vm,) = await env.vms()
    await env.runner_call(vm, "/acquire", {"wait": 0})
    await env.pass_after(31)  # the poll sees the job in progress on our runner
    table = env.ctx.jobs_of((env.ns, POOL))
    assert table is not None and table.jobs[job.id].status == "in_progress"
    assert (await env.vm(vm["metadata"]["name"]))["status"]["job"]["id"] == job.id

    await env.runner_call(vm, f"/jobs/{job.id}/complete", {"conclusion": "success"})
    await env.pass_after(31)  # no webhook reaches the operator: only the next poll can tell
    assert job.id not in table.jobs
    assert table.running_on([vm["metadata"]["name"]]) == {}


async def test_the_webhook_secret_stays_known_while_a_pass_rereads_it(env: PoolEnv) -> None:
    """A delivery that arrives while a pass re-reads the pool's webhook Secret must still
    verify for that pool (else its job is routed without it, and waits for a safety poll)."""
    await env.create_class_and_template()
    await env.create_credentials()
    data = {"webhook_secret": base64.b64encode(b"hook-secret").decode()}
    await env.kube.create(Secret(metadata=ObjectMeta(name="hook", namespace=env.ns), data=data))
    await env.create_pool(mode="webhook", webhook={"secretRef": {"name": "hook"}})
    await env.run_pass()
    mem = env.ctx.pool((env.ns, POOL))
    assert mem.webhook_secret == "hook-secret"
    seen: set[str | None] = set()
    task = env.start_pass()
    while not task.done():
        seen.add(mem.webhook_secret)
        await asyncio.sleep(0)
    await env.finish_pass(task)
    assert seen == {"hook-secret"}


async def test_pools_of_one_installation_share_one_client_and_its_tokens(env: PoolEnv) -> None:
    """Two pools whose credentials Secrets name the same App installation use one client: one
    token cache, so the second pool mints no token of its own; the reaper gets the same one."""
    await env.ready_pool()
    await env.run_pass()
    tokens = len(env.requests("POST", "/app/installations/{installation_id}/access_tokens"))
    assert tokens > 0
    await env.kube.create(app_secret("creds-2", env.ns, APP_ID, INSTALLATION_ID, env.private_key))
    other = "ci-pool-2"
    await env.create_pool(other)
    await env.kube.patch(
        ImpVMRunnerPoolResource,
        other,
        {"spec": {"platform": {"credentialsSecret": "creds-2"}}},
        namespace=env.ns,
        patch_type=PatchType.MERGE,
    )
    await PoolReconciler(env.ctx).reconcile((env.ns, other))
    assert len(env.requests("POST", "/app/installations/{installation_id}/access_tokens")) == tokens
    first = (await env.pool())["spec"]["platform"]
    second = (await env.kube.get(ImpVMRunnerPoolResource, other, namespace=env.ns)).to_dict()
    a = await env.ctx.github.client(env.ns, Platform.model_validate(first))
    b = await env.ctx.github.client(env.ns, Platform.model_validate(second["spec"]["platform"]))
    assert a is b


async def test_polling_pools_of_one_installation_share_each_poll(env: PoolEnv) -> None:
    """Two polling pools of one installation: the second pool's passes are answered by the poll
    the first one's started (one poll per interval, not one per pool), and both see its job."""
    await env.ready_pool()
    other = "ci-pool-2"
    await env.create_pool(other)
    second = PoolReconciler(env.ctx)
    polls = lambda: len(env.requests("GET", RUNS_PATH))  # noqa: E731
    await env.run_pass()
    after_first = polls()
    assert after_first == 2  # queued and in_progress of the one repository
    await second.reconcile((env.ns, other))
    assert polls() == after_first  # the first poll answered the second pool
    env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    await env.pass_after(31)
    await second.reconcile((env.ns, other))
    assert polls() == 2 * after_first  # one more poll, for both
    a = (await env.status())["lastPoll"]
    b = (await env.kube.get(ImpVMRunnerPoolResource, other, namespace=env.ns)).to_dict()
    assert b["status"]["lastPoll"] == a and a["queuedJobs"] == 1
