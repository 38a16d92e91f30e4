"""One broken template must not spend the installation for everyone, end to end on the
embedded stack (real control plane, the GitHub stand-in, the operator and one agent with the
``process`` runtime as real processes): a template whose runner layer's ``run.sh`` exits 1 at
start makes a bounded number of VMs and JIT configs in a minute (before: one every few seconds,
3.5 a second with a fast runtime), its pool says ``TemplateFailing`` with the template and the
exit reason, the example pool of the same installation still runs a job meanwhile, and fixing
the template (another runner layer) recovers the pool at once."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube.types import PatchType

from impvm.api.resources import ImpVMTemplateResource
from impvm.api.times import parse_time
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE
from impvm.devstack.stack import Stack, wait_for
from impvm.devstack.testimages import build_runner_layer_image

pytestmark = [pytest.mark.controlplane]

BROKEN = "broken"
JIT_PATH = "/orgs/{org}/actions/runners/generate-jitconfig"
WINDOW = 60.0


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def _broken_template(stack: Stack, work: Path) -> str:
    """A template like the example's whose runner exits 1 at once; returns its runner layer."""
    assert stack.kube is not None and stack.registry is not None
    layer = await build_runner_layer_image(
        work,
        stack.registry.address,
        run_sh="#!/bin/sh\necho 'no runner here' >&2\nexit 1\n",
        tag=BROKEN,
    )
    tmpl = (await stack.kube.get(ImpVMTemplateResource, "gh-runner", namespace=NAMESPACE)).to_dict()
    spec = dict(tmpl["spec"], runnerLayer=layer)
    body = {
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVMTemplate",
        "metadata": {"name": BROKEN, "namespace": NAMESPACE},
        "spec": spec,
    }
    await stack.kube.create(ImpVMTemplateResource.from_dict(body))
    return layer


def _mints(stack: Stack, since: float) -> int:
    assert stack.standin is not None
    return sum(
        1
        for r in stack.standin.state.requests
        if r["path"] == JIT_PATH and r.get("status") == 201 and r["time"] >= since
    )


async def test_a_template_whose_runner_exits_at_start_is_backed_off(
    stack: Stack, tmp_path: Path
) -> None:
    assert stack.kube is not None and stack.images is not None
    await _broken_template(stack, tmp_path / "layer-broken")

    async def example_idle() -> bool:
        return (await stack.pool_status()).get("idle") == 1

    await wait_for("the example pool's idle runner", example_idle, 180, stack)
    start = time.time()
    await stack.add_pool(
        BROKEN, ["self-hosted", BROKEN], min_idle=1, max_concurrent=5, extra={"template": BROKEN}
    )

    async def failing() -> dict[str, Any] | None:
        conds = (await stack.pool_status(BROKEN)).get("conditions") or []
        c = next((c for c in conds if c["type"] == "TemplateFailing"), None)
        return c if c is not None and c["status"] == "True" else None

    cond = await wait_for("TemplateFailing on the broken pool", failing, 120, stack)
    assert f"template {BROKEN!r}" in cond["message"] and cond["reason"] == "Error"
    assert "exit code 1" in cond["message"]

    # meanwhile the example pool of the same installation runs a job
    (job,) = stack.queue_jobs(1, sleep=1.0)

    async def done() -> bool:
        return any(j.id == job and j.status == "completed" for j in stack.jobs())

    await wait_for("the example pool's job", done, 180, stack)
    await asyncio.sleep(max(0.0, start + WINDOW - time.time()))  # the window the mints count in
    minted = _mints(stack, start)
    # the broken pool makes a VM at 0 s, then 5, 10, 20 s after each failure (each failure
    # takes a boot), the example pool one replacement for its job: at most 5 + 1 in a minute
    assert minted <= 6, f"{minted} JIT configs in {WINDOW:.0f} s"

    # the template is fixed: the pool makes a VM at once (before the backoff would have let it),
    # its runner comes online
    said = await failing()
    assert said is not None
    wait_until = _next_at(said["message"])
    patch = {"spec": {"runnerLayer": stack.images.runner_layer}}
    await stack.kube.patch(
        ImpVMTemplateResource, BROKEN, patch, namespace=NAMESPACE, patch_type=PatchType.MERGE
    )

    async def recovered() -> bool:
        st = await stack.pool_status(BROKEN)
        conds = {c["type"]: c for c in st.get("conditions") or []}
        return st.get("idle") == 1 and conds["TemplateFailing"]["status"] == "False"

    fixed_at = dt.datetime.now(dt.UTC)
    await wait_for("the fixed template's idle runner", recovered, 120, stack)
    made = [
        parse_time(v["metadata"]["creationTimestamp"])
        for v in await stack.vms()
        if v["spec"].get("runnerLayer") == stack.images.runner_layer
        and v["metadata"]["labels"]["imp.dev/runner-pool"] == BROKEN
    ]
    assert made, "no VM of the fixed template"
    if wait_until is not None and wait_until > fixed_at + dt.timedelta(seconds=5):
        assert min(m for m in made if m is not None) < wait_until, "the fix waited out the backoff"


def _next_at(message: str) -> dt.datetime | None:
    """When the condition said the next VM would be made (None: now)."""
    _, sep, rest = message.rpartition("the next VM is made at ")
    return parse_time(rest.strip()) if sep else None
