"""Demand that never loses a job, on the embedded stack: real control plane, GitHub
stand-in delivering signed webhooks, operator and agent processes."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import INSTALLATION_ID, ORG, POOL, REPO
from impvm.devstack.stack import Stack, wait_for
from impvm.github import AppCredentials, GitHubClient, Scope
from impvm.scaling.settings import PassSettings
from tests.github.gh_support import webhook_examples

pytestmark = [pytest.mark.controlplane]

IMPLICIT = {"self-hosted", "linux", "x64"}


@pytest.fixture
async def hook_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", scaling_mode="webhook"))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def queued_example(job_id: int, labels: list[str]) -> dict[str, Any]:
    """The @octokit/webhooks-examples ``queued`` payload, pointed at our org's repository."""
    (ex,) = [e for e in webhook_examples() if e.get("action") == "queued"][:1]
    p = copy.deepcopy(ex)
    p["workflow_job"]["id"] = job_id
    p["workflow_job"]["labels"] = labels
    p["repository"]["full_name"] = REPO
    p["repository"]["name"] = REPO.split("/")[1]
    p["repository"]["owner"]["login"] = ORG
    # GitHub names the App installation the delivery is for: the stack's (a delivery naming
    # another installation feeds no pool of this one)
    p["installation"] = {"id": INSTALLATION_ID, "node_id": p.get("installation", {}).get("node_id")}
    return p


async def post(stack: Stack, body: bytes, headers: dict[str, str]) -> httpx.Response:
    url = f"http://127.0.0.1:{stack.operator_http_port}/webhooks/github"
    async with httpx.AsyncClient() as c:
        return await c.post(url, content=body, headers=headers)


def headers(
    event: str = "workflow_job", delivery: str | None = None, sig: str | None = None
) -> dict[str, str]:
    h = {
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "Content-Type": "application/json",
    }
    if sig is not None:
        h["X-Hub-Signature-256"] = sig
    return h


async def test_real_payload_drives_scale_up_and_bad_deliveries_change_nothing(
    hook_stack: Stack,
) -> None:
    s = hook_stack

    async def settled() -> bool:
        st = await s.pool_status()
        return st.get("idle") == 1 and st.get("total") == 1

    await wait_for("pool at minIdle", settled, 120, s)
    before = await s.pool_status()

    body = json.dumps(queued_example(987654, ["self-hosted", "imp"])).encode()
    # forged: signed with another secret; missing signature; malformed body; other event
    assert (await post(s, body, headers(sig=sign("not-the-secret", body)))).status_code == 401
    assert (await post(s, body, headers())).status_code == 401
    junk = b'{"action": "queued", "workflow_job": {"id": "x"}}'
    assert (await post(s, junk, headers(sig=sign(s.webhook_secret, junk)))).status_code == 400
    notjson = b"not json"
    assert (await post(s, notjson, headers(sig=sign(s.webhook_secret, notjson)))).status_code == 400
    ping = b'{"zen": "Keep it logically awesome."}'
    r = await post(s, ping, headers(event="ping", sig=sign(s.webhook_secret, ping)))
    assert r.status_code == 202
    await asyncio.sleep(3)  # several reconcile passes
    after = await s.pool_status()
    assert (
        (after["pendingJobs"], after["desired"], after["total"])
        == (
            before["pendingJobs"],
            before["desired"],
            before["total"],
        )
        == (0, 1, 1)
    )

    # the real payload, correctly signed: the pool scales up at once (webhook wakes it)
    delivery = str(uuid.uuid4())
    r = await post(s, body, headers(delivery=delivery, sig=sign(s.webhook_secret, body)))
    assert r.status_code == 202, r.text

    async def scaled() -> bool:
        st = await s.pool_status()
        return st.get("pendingJobs") == 1 and st.get("desired") == 2 and st.get("total") == 2

    await wait_for("scale-up for the delivered job", scaled, 30, s)
    # a replay of the same delivery changes nothing
    r = await post(s, body, headers(delivery=delivery, sig=sign(s.webhook_secret, body)))
    assert r.status_code == 200 and "duplicate" in r.text
    # a second delivery of the same job (new delivery id) changes nothing either
    r = await post(s, body, headers(sig=sign(s.webhook_secret, body)))
    assert r.status_code == 200 and "no change" in r.text
    await asyncio.sleep(2)
    st = await s.pool_status()
    assert st["pendingJobs"] == 1 and st["desired"] == 2


async def _run_burst(
    s: Stack, n: int, mixes: list[list[str]], max_concurrent: dict[str, int], restart_at: int | None
) -> None:
    """Queue ``n`` jobs cycling through label ``mixes``; wait until all completed, sampling VM
    counts per pool; optionally SIGKILL and restart the operator after ``restart_at`` jobs."""
    peak: dict[str, int] = defaultdict(int)
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            counts: dict[str, int] = defaultdict(int)
            for v in await s.vms():
                counts[v["metadata"]["labels"]["imp.dev/runner-pool"]] += 1
            for k, c in counts.items():
                peak[k] = max(peak[k], c)
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    ids: list[int] = []
    try:
        for i in range(n):
            ids += s.queue_jobs(1, labels=mixes[i % len(mixes)], sleep=1.0)
            if restart_at is not None and i == restart_at:
                s.kill("operator")
                await asyncio.sleep(1.0)
                s.start_operator()
            await asyncio.sleep(0.05)

        async def all_done() -> bool:
            jobs = [j for j in s.jobs() if j.id in ids]
            return len(jobs) == n and all(j.status == "completed" for j in jobs)

        await wait_for(f"{n} jobs completed", all_done, 420, s, interval=1.0)
    finally:
        stop.set()
        await sampler

    jobs = [j for j in s.jobs() if j.id in ids]
    assert all(j.conclusion == "success" for j in jobs)
    assert len({j.runner_name for j in jobs}) == n  # one VM per job
    pool_labels = {POOL: {"imp"}, "big": {"imp", "big"}, "gpu": {"imp", "gpu"}}
    for j in jobs:
        pool = next(p for p in pool_labels if j.runner_name.startswith(p + "-"))
        assert {x.lower() for x in j.labels} <= pool_labels[pool] | IMPLICIT, (j.labels, pool)
    for pool, cap in max_concurrent.items():
        assert peak[pool] <= cap, (pool, peak[pool], cap)


async def _settle_and_check_no_leaks(s: Stack) -> None:
    async def no_leak() -> bool:
        names = {v["metadata"]["name"] for v in await s.vms()}
        return {r.name for r in s.runners()} <= names

    await wait_for("no registration without a VM", no_leak, 120, s)


@pytest.fixture
async def hybrid_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(
        StackConfig(
            workdir=tmp_path / "stack",
            scaling_mode="hybrid",
            webhook_drop_rate=0.3,
            polling_interval_seconds=10,
        )
    )
    try:
        await s.start()
        await s.add_pool("big", ["imp", "big"], max_concurrent=4)
        await s.add_pool("gpu", ["imp", "gpu"], max_concurrent=3)
        yield s
    finally:
        await s.stop()


async def test_burst_across_three_pools_with_lost_webhooks(hybrid_stack: Stack) -> None:
    """50 jobs, overlapping labels, 30% of webhooks lost (hybrid: polling repairs them)."""
    s = hybrid_stack
    mixes = [["self-hosted", "imp"], ["self-hosted", "imp", "big"], ["imp", "gpu"], ["IMP"]]
    await _run_burst(s, 50, mixes, {POOL: 5, "big": 4, "gpu": 3}, restart_at=None)
    dropped = [d for d in s.standin.state.deliveries if d.error == "dropped"]  # type: ignore[union-attr]
    assert dropped, "the stand-in was meant to lose deliveries"
    await _settle_and_check_no_leaks(s)


async def test_operator_killed_mid_burst(hybrid_stack: Stack) -> None:
    s = hybrid_stack
    mixes = [["self-hosted", "imp"], ["imp", "big"], ["imp", "gpu"]]
    await _run_burst(s, 24, mixes, {POOL: 5, "big": 4, "gpu": 3}, restart_at=10)
    await _settle_and_check_no_leaks(s)


async def test_orphans_both_ways_and_foreign_runner_untouched(tmp_path: Path) -> None:
    s = Stack(StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5))
    try:
        await s.start()

        async def settled() -> bool:
            st = await s.pool_status()
            return st.get("idle") == 1 and st.get("total") == 1

        await wait_for("pool at minIdle", settled, 120, s)
        (vm,) = await s.vms()
        prefix = vm["metadata"]["name"].rsplit("-", 1)[0] + "-"
        creds = AppCredentials(
            app_id=4242,
            installation_id=777,
            private_key=__import__("pydantic").SecretStr(s.private_key_pem),
        )
        gh = GitHubClient(creds, api_url=s.standin.url)  # type: ignore[union-attr]
        scope = Scope(org=ORG)
        group = await gh.runner_group_id(ORG, "omni-runner")
        # a registration with this pool's prefix but no VM (offline): removed
        orphan = await gh.generate_jitconfig(scope, prefix + "orphan1", group, ["imp"])
        # a runner registered by something else in the same org: never touched
        foreign = await gh.generate_jitconfig(scope, "someone-else-1", group, ["imp"])

        async def orphan_gone() -> bool:
            ids = {r.id for r in s.runners()}
            return orphan.runner_id not in ids

        # an idle pool reads GitHub's runner list at most every idle_runner_list_seconds (60 s):
        # the orphan is seen by the first list after it was made, and removed by that pass
        limit = PassSettings().idle_runner_list_seconds + 60
        await wait_for("orphan registration removed", orphan_gone, limit, s)
        assert foreign.runner_id in {r.id for r in s.runners()}

        # a VM whose registration vanished while idle is replaced
        idle = (await s.vms())[0]
        rid = idle["status"]["runner"]["id"]
        del s.standin.state.runners[rid]  # type: ignore[union-attr]

        async def replaced() -> bool:
            names = {v["metadata"]["name"] for v in await s.vms()}
            st = await s.pool_status()
            return idle["metadata"]["name"] not in names and st.get("idle") == 1

        await wait_for("idle VM without registration replaced", replaced, 90, s)

        # a VM whose runner never comes online within bootstrapTimeoutSeconds is removed with
        # its registration: stop the agent so new VMs never start
        s.kill("agent-node-1")
        from impvm.api.resources import ImpVMRunnerPoolResource

        assert s.kube is not None
        await s.kube.patch(
            ImpVMRunnerPoolResource,
            POOL,
            {"spec": {"bootstrapTimeoutSeconds": 30, "scaling": {"minIdle": 2}}},
            namespace="default",
            patch_type=__import__("lightkube.types", fromlist=["PatchType"]).PatchType.MERGE,
        )

        async def stuck_vm() -> dict[str, Any] | None:
            for v in await s.vms():
                if (v.get("status") or {}).get("runner", {}).get("id") and not (
                    v.get("status") or {}
                ).get("phase"):
                    return v
            return None

        stuck = await wait_for("a VM that cannot start", stuck_vm, 60, s)
        stuck_rid = stuck["status"]["runner"]["id"]

        async def timed_out() -> bool:
            names = {v["metadata"]["name"] for v in await s.vms()}
            return stuck["metadata"]["name"] not in names and stuck_rid not in {
                r.id for r in s.runners()
            }

        await wait_for("bootstrap timeout", timed_out, 90, s)
        assert foreign.runner_id in {r.id for r in s.runners()}
        await gh.close()
    finally:
        await s.stop()
