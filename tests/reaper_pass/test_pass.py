"""One reaper pass (mirroring the test of ARC's reaper proposal) on the real control plane
against the GitHub stand-in over real HTTP: which VMs go, which stay, what GitHub was asked,
and what the pool reports."""

from __future__ import annotations

import asyncio
import logging

import pytest
from lightkube import AsyncClient
from lightkube.types import PatchType

from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.github import GitHubClient
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.reaper import STALE_RECHECK_SECONDS, Reaper, reap_pool, reaper_loop
from impvm.reaper import Rule

from .conftest import (
    GRANTED,
    INSTALLATION_ID,
    JOB_PATH,
    RUN_PATH,
    TOKEN_PATH,
    World,
    four_vms,
    now,
)

pytestmark = [pytest.mark.controlplane]


def assert_no_secrets(world: World, *texts: str) -> None:
    secrets = world.secret_values()
    assert secrets, "nothing to look for"
    for text in texts:
        for value in secrets:
            assert value not in text


def pool_texts(world: World) -> list[str]:
    """Every Event message about the pool and the pool's whole status, as text."""
    return [str(e.message) for e in world.events()] + [str(world.refresh_pool().get("status"))]


async def test_four_vms_one_pass(
    world: World, akube: AsyncClient, github: GitHubClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="impvm")
    world.create_pool()
    # the pool controller's own condition must survive the reaper's status write
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "Reconciled",
        "message": "0 idle",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    world.kube.patch(
        ImpVMRunnerPoolResource.Status,
        world.pool_name,
        {"status": {"conditions": [ready]}},
        namespace=world.namespace,
        patch_type=PatchType.MERGE,
    )
    four_vms(world)
    # a VM of another pool in the same namespace, with a long-finished run: not this pass's
    other_pool = world.create_pool("other")
    other = world.seed(
        run_status="completed",
        run_conclusion="success",
        run_updated_ago=86400,
        job_status="completed",
        job_conclusion="success",
        job_completed_ago=86400,
    )
    other_vm = world.create_vm("done", other, pool=other_pool)
    world.standin.state.requests.clear()

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    v = world.vms
    assert sorted(o.vm for o in report.deleted) == sorted([v["hung"], v["cancelled"]])
    assert sorted(o.vm for o in report.kept) == sorted([v["idle"], v["busy"]])
    assert report.not_judged == 0 and report.error is None and report.complete
    assert report.would_delete == [] and report.failed == []
    rules = {o.vm: o.verdict.rule for o in report.deleted + report.kept}
    assert rules == {
        v["hung"]: Rule.JOB_TOO_LONG,
        v["cancelled"]: Rule.RUN_COMPLETED,
        v["idle"]: Rule.IDLE,
        v["busy"]: Rule.RUNNING,
    }
    assert world.vm_names() == {v["idle"], v["busy"], other_vm}

    # GitHub: exactly one token, restricted to actions: read; reads of only the three runs
    tokens = world.requests(TOKEN_PATH)
    assert len(tokens) == 1
    assert tokens[0]["permissions"] == {"actions": "read"} and tokens[0]["status"] == 201
    assert [t.permissions for t in world.standin.state.tokens.values()] == [{"actions": "read"}]
    assert len(world.requests(RUN_PATH)) == 3
    assert len(world.requests(JOB_PATH)) == 2  # hung and busy; the cancelled run is completed
    assert {r["path"] for r in world.requests()} == {TOKEN_PATH, RUN_PATH, JOB_PATH}
    assert all(r["method"] == "GET" for r in world.requests() if r["path"] != TOKEN_PATH)
    assert all(r["status"] == 200 for r in world.requests(RUN_PATH) + world.requests(JOB_PATH))

    # each deletion is logged and evented with run, repository and reason
    reaped = world.events("RunnerReaped")
    assert len(reaped) == 2
    by_vm = {o.vm: o for o in report.deleted}
    for name in (v["hung"], v["cancelled"]):
        outcome = by_vm[name]
        (event,) = [e for e in reaped if name in str(e.message)]
        assert event.type == "Normal"
        for part in (f"run {outcome.run_id}", "octo-org/app", outcome.verdict.reason):
            assert part in str(event.message)
            assert part in caplog.text
    assert "cancelled" in str(by_vm[v["cancelled"]].verdict.reason)
    assert "past the 1h bound" in str(by_vm[v["hung"]].verdict.reason)

    cond = world.condition()
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "PassComplete"
    assert "deleted 2" in cond["message"] and "not judged 0" in cond["message"]
    assert world.condition("Ready") == ready
    assert not world.events("ReaperTokenRefused")
    assert_no_secrets(world, caplog.text, *pool_texts(world))

    # a second pass: nothing left to delete, the cached token is reused
    again = await reap_pool(akube, github, world.refresh_pool(), now())
    assert again.deleted == [] and sorted(o.vm for o in again.kept) == sorted(
        [v["idle"], v["busy"]]
    )
    assert len(world.requests(TOKEN_PATH)) == 1
    assert world.vm_names() == {v["idle"], v["busy"], other_vm}


async def test_token_refused_deletes_nothing(
    world: World, akube: AsyncClient, github: GitHubClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="impvm")
    # the App was never granted actions: read on this installation
    world.standin.state.installations[INSTALLATION_ID].permissions = {
        k: v for k, v in GRANTED.items() if k != "actions"
    }
    world.create_pool()
    four_vms(world)
    before = world.vm_names()
    world.standin.state.requests.clear()

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    assert report.deleted == [] and report.kept and not report.complete
    assert report.error_reason == "TokenRefused"
    assert report.error is not None and "lacks the permission actions: read" in report.error
    assert report.not_judged == 3  # hung, cancelled, busy: none judged
    assert world.vm_names() == before
    tokens = world.requests(TOKEN_PATH)
    assert len(tokens) == 1 and tokens[0]["status"] == 422
    assert tokens[0]["permissions"] == {"actions": "read"}
    assert world.requests(RUN_PATH) == [] and world.requests(JOB_PATH) == []
    assert world.standin.state.tokens == {}

    cond = world.condition()
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "TokenRefused"
    assert "actions: read" in cond["message"] and "deleted nothing" in cond["message"]
    (event,) = world.events("ReaperTokenRefused")
    assert event.type == "Warning" and "actions: read" in str(event.message)
    assert not world.events("RunnerReaped")
    assert_no_secrets(world, caplog.text, *pool_texts(world))

    # the same refusal again: reported in the condition, not a second Warning Event
    await reap_pool(akube, github, world.refresh_pool(), now())
    assert len(world.events("ReaperTokenRefused")) == 1
    assert world.vm_names() == before

    # once the permission is granted, the next pass judges and deletes
    world.standin.state.installations[INSTALLATION_ID].permissions = dict(GRANTED)
    fixed = await reap_pool(akube, github, world.refresh_pool(), now())
    assert len(fixed.deleted) == 2 and fixed.complete
    cond = world.condition()
    assert cond is not None and cond["status"] == "True"


async def test_unreadable_run_is_kept_and_others_judged(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    world.create_pool()
    four_vms(world)
    gone = world.seed(
        run_status="completed",
        run_conclusion="cancelled",
        run_updated_ago=86400,
        job_status="completed",
        job_completed_ago=86400,
    )
    del world.standin.state.runs[gone.run_id]  # GitHub answers 404 for this run
    world.create_vm("unreadable", gone)
    world.standin.state.requests.clear()

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    v = world.vms
    assert report.not_judged == 1 and not report.complete and report.error is None
    (unjudged,) = report.unjudged
    assert unjudged.vm == v["unreadable"] and unjudged.verdict.rule is Rule.LOOKUP_FAILED
    assert "404" in unjudged.verdict.reason
    assert sorted(o.vm for o in report.deleted) == sorted([v["hung"], v["cancelled"]])
    assert world.vm_names() == {v["idle"], v["busy"], v["unreadable"]}
    statuses = sorted(r["status"] for r in world.requests(RUN_PATH))
    assert statuses == [200, 200, 200, 404]

    cond = world.condition()
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "NotJudged"
    assert "not judged 1" in cond["message"] and v["unreadable"] in cond["message"]
    (event,) = world.events("ReaperNotJudged")
    assert event.type == "Warning" and "not judged 1" in str(event.message)


async def test_completed_inside_grace_is_kept(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    world.create_pool(completedGraceSeconds=300)
    job_done = world.seed(
        run_status="in_progress",
        job_status="completed",
        job_conclusion="success",
        job_started_ago=70,
        job_completed_ago=10,
    )
    run_done = world.seed(
        run_status="completed",
        run_conclusion="success",
        run_updated_ago=10,
        job_status="completed",
        job_conclusion="success",
        job_started_ago=70,
        job_completed_ago=10,
    )
    job_long_done = world.seed(
        run_status="in_progress",
        job_status="completed",
        job_conclusion="success",
        job_started_ago=900,
        job_completed_ago=600,
    )
    world.create_vm("job-done", job_done)
    world.create_vm("run-done", run_done)
    world.create_vm("job-long-done", job_long_done)

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    v = world.vms
    assert {o.vm: o.verdict.rule for o in report.kept} == {
        v["job-done"]: Rule.IN_GRACE,
        v["run-done"]: Rule.IN_GRACE,
    }
    assert [(o.vm, o.verdict.rule) for o in report.deleted] == [
        (v["job-long-done"], Rule.JOB_COMPLETED)
    ]
    assert world.vm_names() == {v["job-done"], v["run-done"]}


async def test_dry_run_deletes_nothing(
    world: World, akube: AsyncClient, github: GitHubClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="impvm")
    world.create_pool(dryRun=True)
    four_vms(world)
    before = world.vm_names()

    report = await reap_pool(akube, github, world.refresh_pool(), now(), deregister=github)

    v = world.vms
    assert report.deleted == [] and report.complete
    assert sorted(o.vm for o in report.would_delete) == sorted([v["hung"], v["cancelled"]])
    assert world.vm_names() == before
    for o in report.would_delete:
        assert f"would delete VM {o.vm} (dry run): {o.verdict.reason}" in caplog.text
    assert not world.events("RunnerReaped")
    # no runner was deregistered either, and no token beyond actions: read was minted
    assert [r for r in world.requests() if r["method"] == "DELETE"] == []
    assert [r["permissions"] for r in world.requests(TOKEN_PATH)] == [{"actions": "read"}]
    assert {r.name for r in world.standin.state.runners.values()} >= {"cancelled-runner"}
    cond = world.condition()
    assert cond is not None and cond["status"] == "True"
    assert "would delete 2 (dry run)" in cond["message"]


async def test_deregisters_when_possible_then_deletes(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    world.create_pool()
    four_vms(world)

    report = await reap_pool(akube, github, world.refresh_pool(), now(), deregister=github)

    v = world.vms
    dereg = {o.vm: o.deregistration for o in report.deleted}
    # the cancelled run's runner is deregistered; the hung job's runner is busy at GitHub
    # (422) and its VM is deleted anyway
    assert dereg == {v["cancelled"]: "deleted", v["hung"]: "busy"}
    runners = {r.name for r in world.standin.state.runners.values()}
    assert "cancelled-runner" not in runners
    assert {"hung-runner", "busy-runner"} <= runners
    assert world.vm_names() == {v["idle"], v["busy"]}
    deletes = [r for r in world.requests() if r["method"] == "DELETE"]
    assert sorted(r["status"] for r in deletes) == [204, 422]
    # reads used an actions: read token; deregistration its own runner-scoped token
    perms = sorted(str(r["permissions"]) for r in world.requests(TOKEN_PATH))
    assert perms == sorted(
        [str({"actions": "read"}), str({"organization_self_hosted_runners": "write"})]
    )
    hung_event = next(e for e in world.events("RunnerReaped") if v["hung"] in str(e.message))
    assert "still busy" in str(hung_event.message)


async def test_disabled_reaper_touches_nothing(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    world.create_pool(enabled=False)
    four_vms(world)
    before = world.vm_names()
    world.standin.state.requests.clear()

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    assert report.skipped and report.deleted == [] and report.kept == []
    assert world.vm_names() == before
    assert world.requests() == []
    assert world.condition() is None


async def test_vm_not_controlled_by_the_pool_is_never_touched(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    """A VM carrying the pool's label but created by someone else (another pool's uid) is
    neither read nor deleted (GARM: only touch what this pool created)."""
    world.create_pool()
    stranger_pool = world.create_pool("stranger")
    done = world.seed(
        run_status="completed",
        run_conclusion="cancelled",
        run_updated_ago=86400,
        job_status="completed",
        job_completed_ago=86400,
    )
    name = world.create_vm("foreign", done, pool=stranger_pool)
    # relabel it into our pool: the label matches, the controller does not
    world.kube.patch(
        ImpVMResource,
        name,
        {"metadata": {"labels": {"imp.dev/runner-pool": world.pool_name}}},
        namespace=world.namespace,
        patch_type=PatchType.MERGE,
    )
    world.standin.state.requests.clear()

    report = await reap_pool(akube, github, world.refresh_pool(), now())

    assert report.deleted == [] and report.kept == [] and report.not_judged == 0
    assert name in world.vm_names()
    assert world.requests() == []


async def test_operator_loop_runs_passes_with_one_token(
    world: World, akube: AsyncClient, standin_url: str
) -> None:
    """The loop the kopf daemon runs: reads the App Secret, builds its client, runs a pass,
    sleeps spec.reaper.intervalSeconds, runs again (passes strictly one after the other); the
    actions: read token is minted once for both passes."""
    world.create_pool(intervalSeconds=42)
    four_vms(world)
    world.standin.state.requests.clear()
    ctx = OperatorContext(akube, OperatorSettings(github_api_url=standin_url))
    sleeps: list[float] = []
    second_pass_done = asyncio.Event()

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) >= 2:
            second_pass_done.set()
            await asyncio.Event().wait()  # park until cancelled

    task = asyncio.create_task(reaper_loop(ctx, (world.namespace, world.pool_name), sleep=sleep))
    try:
        await asyncio.wait_for(second_pass_done.wait(), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctx.close()
    assert sleeps == [42.0, 42.0]
    v = world.vms
    assert world.vm_names() == {v["idle"], v["busy"]}
    actions_tokens = [
        r for r in world.requests(TOKEN_PATH) if r["permissions"] == {"actions": "read"}
    ]
    assert len(actions_tokens) == 1
    # the in-operator loop deregisters through the App's runner permission
    assert "cancelled-runner" not in {r.name for r in world.standin.state.runners.values()}
    cond = world.condition()
    assert cond is not None and cond["status"] == "True"


async def test_a_loop_started_before_its_cache_shows_the_reaper_enabled_runs_its_pass_soon(
    world: World, akube: AsyncClient, standin_url: str
) -> None:
    """kopf starts the loop on the event that enabled the reaper, and the loop may read the pool
    before that change (a lagging cache): it reads again within a second, not after the old
    spec's interval (300 s by default), and then runs its pass at the new interval."""
    world.create_pool(enabled=False, intervalSeconds=300)
    four_vms(world)
    ctx = OperatorContext(akube, OperatorSettings(github_api_url=standin_url))
    sleeps: list[float] = []
    passed = asyncio.Event()

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 1:  # the change reaches the cache while the loop waits
            world.kube.patch(
                ImpVMRunnerPoolResource,
                world.pool_name,
                {"spec": {"reaper": {"enabled": True, "intervalSeconds": 42}}},
                namespace=world.namespace,
                patch_type=PatchType.MERGE,
            )
            return
        passed.set()
        await asyncio.Event().wait()  # park until cancelled

    task = asyncio.create_task(reaper_loop(ctx, (world.namespace, world.pool_name), sleep=sleep))
    try:
        await asyncio.wait_for(passed.wait(), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctx.close()
    assert sleeps == [STALE_RECHECK_SECONDS, 42.0]
    assert world.vm_names() == {world.vms["idle"], world.vms["busy"]}


@pytest.fixture
def standin_url(world: World) -> str:
    return world.standin.url


async def test_pass_locks_are_not_kept_after_the_pass(
    world: World, akube: AsyncClient, github: GitHubClient
) -> None:
    """Passes of one pool are serialised by a lock (the reaper's, not a module's) that lives
    only while a pass runs: pools come and go, and their locks must not pile up in the
    operator's memory."""
    import gc

    world.create_pool()
    four_vms(world)
    reaper = Reaper(akube)
    first, second = (
        asyncio.create_task(reaper.reap(github, world.refresh_pool(), now())) for _ in range(2)
    )
    await asyncio.sleep(0)
    assert len(reaper.locks) == 1  # both passes share one lock
    await asyncio.gather(first, second)
    gc.collect()
    assert len(reaper.locks) == 0
