"""A template roll-out pass after pass, carried out by the real executor against the real API
server and the GitHub stand-in: replacements are made first, at most scaleUpStep outdated VMs
go per pass, never while fewer than minIdle idle runners would stay ready, and a busy outdated
VM finishes its job first."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.types import PatchType

from impvm.api.resources import ImpVMTemplateResource
from impvm.devstack.seed import REPO
from impvm.operator.pool import PoolReconciler
from tests.operator.conftest import BASE_IMAGE, POOL, TEMPLATE, PoolEnv

pytestmark = [pytest.mark.controlplane]

NEW_IMAGE = "registry.example/imp/runner-base@sha256:" + "7" * 64


async def _online_new(env: PoolEnv) -> None:
    """The replacements' runners come online as their guests boot."""
    for vm in await env.vms():
        name = vm["metadata"]["name"]
        if vm["spec"]["image"] != NEW_IMAGE or not vm["spec"].get("runnerConfigSecret"):
            continue
        if any(r.status != "online" for r in env.runners_named(name)):
            await env.runner_call(vm, "/session")


def _ready(env: PoolEnv, gone: set[str]) -> set[str]:
    """Idle runners GitHub lists online whose VM is not being removed."""
    st = env.standin.state
    return {r.name for r in st.runners.values() if r.status == "online" and not r.busy} - gone


async def test_a_rollout_keeps_min_idle_ready_and_lets_busy_vms_finish(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=3, scaleUpStep=1, maxConcurrent=10)
    reconciler = PoolReconciler(env.ctx)
    for _ in range(3):
        await reconciler.reconcile((env.ns, POOL))
    old = await env.vms()
    assert len(old) == 3 and {v["spec"]["image"] for v in old} == {BASE_IMAGE}
    await env.bring_online()
    env.standin.state.queue_job(REPO, ["self-hosted", "imp"])
    busy: dict[str, Any] = old[0]
    await env.runner_call(busy, "/acquire", {"wait": 0})
    await env.patch_scaling(minIdle=2)
    await reconciler.reconcile((env.ns, POOL))

    patch = {"spec": {"image": NEW_IMAGE}}
    await env.kube.patch(
        ImpVMTemplateResource, TEMPLATE, patch, namespace=env.ns, patch_type=PatchType.MERGE
    )
    await reconciler.reconcile((env.ns, POOL))
    assert reconciler.last is not None
    acts, end = reconciler.last
    assert end.status.outdated == 3
    # desired = busy 1 + minIdle 2 = 3; supply counts only the busy one: replacements first
    assert acts.create == 1 and acts.deletions == ()
    for _ in range(12):
        await _online_new(env)
        await reconciler.reconcile((env.ns, POOL))
        assert reconciler.last is not None
        acts, end = reconciler.last
        gone = {d.name for d in acts.deletions}
        assert len(gone) <= 1, "more than scaleUpStep outdated VMs went in one pass"
        assert len(_ready(env, gone)) >= 2, "fewer than minIdle runners stayed ready"
    names = {v["metadata"]["name"] for v in await env.vms()}
    assert busy["metadata"]["name"] in names  # busy: it finishes its job first
    assert not {v["metadata"]["name"] for v in old[1:]} & names
    assert (await env.status())["outdated"] == 1
