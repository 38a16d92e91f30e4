"""The pool pass on watch caches and the shared runner directory, against the real API server
and the GitHub stand-in: own writes seen before the watch delivers them (so no registration is
taken for an orphan and no VM is made twice), cache changes waking the pools they concern, one
list per installation shared by concurrent passes, and a pool whose GitHub answers slowly never
holding up another pool."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret
from lightkube.types import PatchType

from impvm.api.models import PoolKey
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import REPO, example_scaling, pool_manifest
from impvm.devstack.standin.records import Failure
from impvm.github import Scope
from impvm.github.errors import GitHubError
from impvm.operator.named import SECRET_VALUE_MAX_BYTES
from impvm.operator.pool import PoolReconciler
from impvm.operator.sources import CachedSource
from impvm.scaling.poolpass import PoolObj
from tests.operator.conftest import POOL, TEMPLATE, PoolEnv
from tests.operator.test_pool_controller import wait_until

pytestmark = [pytest.mark.controlplane]

RUNNERS_PATH = "/orgs/{org}/actions/runners"
RUNNER_PATH = "/orgs/{org}/actions/runners/{runner_id}"
MERGE = PatchType.MERGE


async def listed_once(env: PoolEnv) -> CachedSource:
    """Caches for the test's namespace, each filled by one list and then left without a watch:
    from here on they change only through the operator's own writes."""
    cached = env.ctx.use_caches([env.ns])
    for caches in cached.caches.values():
        for c in caches:
            await c.relist()
    return cached


async def test_own_writes_are_seen_before_any_watch_event(env: PoolEnv) -> None:
    """With no watch delivering anything, the second pass still sees the VM, its Secret and its
    runner id that the first pass wrote: it lists the registration the first pass minted (the
    pool changed its registrations, so the shared list is read again) and takes it for the VM's,
    not for an orphan; it creates no second VM. A VM the pass deleted is seen deleting."""
    await env.ready_pool(minIdle=1)
    cached = await listed_once(env)
    await env.run_pass()
    (made,) = await env.vms()
    pool = PoolObj.from_body(await env.pool())
    (seen,) = await cached.vms(pool)
    assert seen.name == made["metadata"]["name"]
    assert seen.spec.runner_config_secret and seen.status.runner and seen.status.runner.id
    assert await cached.secret_names(pool) == {seen.spec.runner_config_secret}
    lists = len(env.requests("GET", RUNNERS_PATH))

    env.clock.advance(3)
    await env.run_pass()
    assert len(env.requests("GET", RUNNERS_PATH)) == lists + 1  # the new registration
    assert not env.requests("DELETE", RUNNER_PATH), "the VM's registration was taken for orphan"
    assert len(env.standin.state.runners) == 1
    assert [v["metadata"]["name"] for v in await env.vms()] == [seen.name]

    await env.patch_scaling(minIdle=0, cooldownSeconds=0)
    await cached.caches["pools"][0].relist()  # the user's edit, as its watch would deliver it
    env.clock.advance(3)
    await env.run_pass()
    assert not await env.vms()  # deleted on the API server (no finalizer without an agent)
    (gone,) = await cached.vms(pool)  # the cache heard of it from the delete alone
    assert gone.deleting


async def test_cache_changes_wake_the_pools_they_concern(env: PoolEnv) -> None:
    """A VM's change wakes its pool, a template or class edit the pools using it, a pool edit
    the pool; Secret values too large to be a key the operator reads are not kept."""
    await env.ready_pool(minIdle=1)
    cached = env.ctx.use_caches([env.ns])
    await cached.start()
    await cached.synced()
    await env.run_pass()  # the pass records its template and class
    mem = env.ctx.pool(PoolKey(env.ns, POOL))
    (vm,) = await env.vms()

    async def wakes(what: str, change: Any) -> None:
        await asyncio.sleep(0.3)  # the watch delivered the pass's own writes by now
        mem.wake.clear()
        await change()
        await wait_until(f"{what} to wake the pool", mem.wake.is_set)

    name = vm["metadata"]["name"]
    note = {"metadata": {"annotations": {"test": "1"}}}
    await wakes(
        "a VM change",
        lambda: env.kube.patch(ImpVMResource, name, note, namespace=env.ns, patch_type=MERGE),
    )
    await wakes(
        "a template edit",
        lambda: env.kube.patch(
            ImpVMTemplateResource, TEMPLATE, note, namespace=env.ns, patch_type=MERGE
        ),
    )
    await wakes(
        "a class edit",
        lambda: env.kube.patch(ImpVMClassResource, env.class_name, note, patch_type=MERGE),
    )
    await wakes(
        "a pool edit",
        lambda: env.kube.patch(
            ImpVMRunnerPoolResource, POOL, note, namespace=env.ns, patch_type=MERGE
        ),
    )

    small = base64.b64encode(b"s3cret").decode()
    large = base64.b64encode(b"x" * SECRET_VALUE_MAX_BYTES).decode()
    meta = ObjectMeta(name="mixed", namespace=env.ns)
    await env.kube.create(Secret(metadata=meta, data={"small": small, "large": large}))

    async def cached_mixed() -> dict[str, Any] | None:
        return await cached.get(Secret, "mixed", env.ns)

    for _ in range(200):
        if (found := await cached_mixed()) is not None:
            break
        await asyncio.sleep(0.05)
    assert found is not None and found["data"] == {"small": small}


async def test_concurrent_passes_share_one_runner_list(env: PoolEnv) -> None:
    """Requests that arrive while a list is under way wait for it; a fresh-enough list is
    reused; a pool that changed its registrations gets a new list (others keep theirs); a
    failed list reaches every waiter as the same error."""
    await env.ready_pool()
    pool = PoolObj.from_body(await env.pool())
    client = await env.ctx.github.client(env.ns, pool.spec.platform)
    scope = Scope(org=pool.spec.platform.scope.org)
    d, mono = env.ctx.runners, 100.0
    st = env.standin.state

    st.failures.append(Failure(kind="timeout", delay=0.5, method="GET", path=RUNNERS_PATH))
    lists = [d.runners(client, scope, f"p{i}-", 60.0, mono) for i in range(3)]
    assert await asyncio.gather(*lists) == [[], [], []]
    assert len(env.requests("GET", RUNNERS_PATH)) == 1
    await d.runners(client, scope, "p0-", 60.0, mono + 30)
    assert len(env.requests("GET", RUNNERS_PATH)) == 1  # 30 s old: fresh enough
    await d.runners(client, scope, "p0-", 2.0, mono + 30)
    assert len(env.requests("GET", RUNNERS_PATH)) == 2  # this pass wants 2 s at most

    d.changed(client, scope, "p1-", mono + 31)
    await d.runners(client, scope, "p0-", 60.0, mono + 31)
    assert len(env.requests("GET", RUNNERS_PATH)) == 2  # p0 did not change anything
    await d.runners(client, scope, "p1-", 60.0, mono + 31)
    assert len(env.requests("GET", RUNNERS_PATH)) == 3

    st.failures.append(Failure(kind="status", status=502, method="GET", path=RUNNERS_PATH))
    failing = [d.runners(client, scope, f"p{i}-", 0.0, mono + 40) for i in range(2)]
    errors = await asyncio.gather(*failing, return_exceptions=True)
    assert all(isinstance(e, GitHubError) for e in errors), errors
    assert len(env.requests("GET", RUNNERS_PATH)) == 4


async def test_a_pool_whose_github_answers_slowly_never_delays_another_pool(
    env: PoolEnv,
) -> None:
    """The org pool's runner list hangs (8 s); meanwhile a pass of a repository pool of the same
    namespace runs from start to finish and makes its VM with its JIT Secret: no lock or queue
    is shared between pools."""
    await env.ready_pool(minIdle=1)
    scaling = {**example_scaling(), "minIdle": 1}
    body = pool_manifest("repo-pool", env.ns, scaling, template=TEMPLATE)
    body["spec"]["platform"]["scope"] = {"repo": REPO}
    body["spec"]["platform"].pop("runnerGroup", None)
    await env.kube.create(ImpVMRunnerPoolResource.from_dict(body))
    st = env.standin.state
    st.failures.append(Failure(kind="timeout", delay=8.0, method="GET", path=RUNNERS_PATH))

    slow = env.start_pass()
    await wait_until("the org pool's list", lambda: env.requests("GET", RUNNERS_PATH), 5.0)
    await PoolReconciler(env.ctx).reconcile((env.ns, "repo-pool"))
    assert not slow.done(), "the repository pool's pass waited for the org pool's"
    made = [
        v for v in await env.vms() if v["metadata"]["labels"]["imp.dev/runner-pool"] == "repo-pool"
    ]
    assert len(made) == 1 and made[0]["spec"].get("runnerConfigSecret")
    await env.finish_pass(slow)


async def test_a_pool_made_again_under_its_name_is_never_taken_for_the_old_one(
    env: PoolEnv,
) -> None:
    """The pools cache still holds the old pool, deleting, when a new one of the same name
    exists: the pass asks the API server and goes on (its loop ending would be for good), and
    a loop running for the old pool's uid ends instead of deciding for the new one. A cache
    still holding the old pool (not deleting) is not used for a loop of the new uid."""
    old = await env.ready_pool(minIdle=0)
    hold = {"metadata": {"finalizers": ["test.imp.dev/hold"]}}
    kw: Any = {"namespace": env.ns, "patch_type": PatchType.MERGE}
    await env.kube.patch(ImpVMRunnerPoolResource, POOL, hold, **kw)
    await env.kube.delete(ImpVMRunnerPoolResource, POOL, namespace=env.ns)
    await listed_once(env)  # the cache holds the old pool, deleting, and sees nothing after
    await env.kube.patch(ImpVMRunnerPoolResource, POOL, {"metadata": {"finalizers": None}}, **kw)
    new = await env.create_pool(minIdle=1)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert await env.run_pass() is not None
    reconciler = PoolReconciler(env.ctx)
    assert await reconciler.reconcile((env.ns, POOL), old["metadata"]["uid"]) is None
    assert await reconciler.reconcile((env.ns, POOL), new["metadata"]["uid"]) is not None
    await env.collect()
    vms = await env.vms()
    assert vms and all(
        [o["uid"] for o in v["metadata"]["ownerReferences"]] == [new["metadata"]["uid"]]
        for v in vms
    )
