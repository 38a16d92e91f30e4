"""A class narrowed after a pool started using it stops that pool's new VMs: the pool pass
checks the class's ``spec.namespaces`` against the pool's namespace on the real API server,
says so in the condition ``ClassNotAllowed`` (naming the class) and an Event, makes no VM and
lets the ones it has go; the pool resumes once the class admits its namespace again."""

from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType

from impvm.api.resources import ImpVMClassResource
from tests.operator.conftest import PoolEnv

pytestmark = [pytest.mark.controlplane]


async def narrow(env: PoolEnv, labels: dict[str, str]) -> None:
    rule = {"from": "Selector", "selector": {"matchLabels": labels}}
    await env.kube.patch(
        ImpVMClassResource,
        env.class_name,
        {"spec": {"namespaces": rule}},
        patch_type=PatchType.MERGE,
    )


async def test_a_class_narrowed_later_stops_the_pools_new_vms(env: PoolEnv) -> None:
    await env.ready_pool(minIdle=2, scaleUpStep=2, cooldownSeconds=0)
    await env.run_pass()
    assert len(await env.vms()) == 2

    await narrow(env, {"team": "red"})  # the pool's namespace has no such label
    for _ in range(3):
        await env.pass_after(31)
    live = [v for v in await env.vms() if not v["metadata"].get("deletionTimestamp")]
    assert live == []  # none made, and the idle ones went
    assert (await env.status())["desired"] == 0
    cond = (await env.conditions())["ClassNotAllowed"]
    assert cond["status"] == "True" and env.class_name in cond["message"], cond
    assert env.ns in cond["message"]
    assert (await env.conditions())["Ready"]["status"] == "False"
    assert env.events_with("ClassNotAllowed")

    # the admin selects the namespace: the pool goes on
    await env.kube.patch(
        Namespace, env.ns, {"metadata": {"labels": {"team": "red"}}}, patch_type=PatchType.MERGE
    )
    await env.pass_after(31)
    assert (await env.conditions())["ClassNotAllowed"]["status"] == "False"
    await env.pass_after(31)
    live = [v for v in await env.vms() if not v["metadata"].get("deletionTimestamp")]
    assert len(live) == 2
