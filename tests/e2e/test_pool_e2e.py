"""End to end on the embedded stack (issue: pool controller and node agent, "Done when"):
the seed's minimal example on a real control plane, the GitHub stand-in, the operator and one
agent (process runtime, bubblewrap) as real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Event, Secret

from impvm.devstack.devconfig import StackConfig
from impvm.devstack.leaks import Recorder
from impvm.devstack.seed import CREDENTIALS_SECRET, NAMESPACE, RUNNER_GROUP
from impvm.devstack.stack import Stack, wait_for

pytestmark = [pytest.mark.controlplane]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


def live(vms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v for v in vms if not v["metadata"].get("deletionTimestamp")]


async def pool_counts(stack: Stack) -> tuple[int, int, int]:
    st = await stack.pool_status()
    return st.get("idle", -1), st.get("busy", -1), st.get("total", -1)


async def test_seed_example_runs_jobs_each_on_its_own_vm(stack: Stack) -> None:
    with Recorder(stack) as rec:
        # minIdle 1: one idle, registered runner
        async def one_idle() -> bool:
            runners = stack.runners()
            return len(runners) == 1 and runners[0].status == "online" and not runners[0].busy

        await wait_for("one idle registered runner", one_idle, 120, stack)
        assert await wait_for("pool status idle=1", _pool_is(stack, 1, 0, 1), 30, stack)

        # the JIT request carried the pool's labels and the resolved runner-group id
        group = next(
            g for g in stack.standin.state.runner_groups.values() if g.name == RUNNER_GROUP
        )  # type: ignore[union-attr]
        (runner,) = stack.runners()
        assert "imp" in runner.labels and runner.group_id == group.id

        job_ids = stack.queue_jobs(5, sleep=2.0)

        async def all_done() -> bool:
            jobs = [j for j in stack.jobs() if j.id in job_ids]
            return all(j.status == "completed" for j in jobs)

        await wait_for("5 jobs completed", all_done, 240, stack)
        jobs = [j for j in stack.jobs() if j.id in job_ids]
        assert all(j.conclusion == "success" for j in jobs), [(j.id, j.conclusion) for j in jobs]
        runner_names = [j.runner_name for j in jobs]
        assert len(set(runner_names)) == 5, runner_names  # each job on a different VM
        assert all(n and n in rec.vm_names for n in runner_names), (runner_names, rec.vm_names)

        # back to minIdle after the 30 s cooldown: 1 idle runner, 1 VM
        await wait_for("pool back to 1 idle VM", _pool_is(stack, 1, 0, 1), 120, stack)

        async def one_vm() -> bool:
            return len(await stack.vms()) == 1 and len(stack.runners()) == 1

        await wait_for("deleted VMs gone", one_vm, 60, stack)
        assert rec.max_vms <= 5, rec.max_vms  # never more than maxConcurrent at once

    # the operator and agent ran as their ServiceAccounts (deploy/rbac): nothing was refused
    for name in ("operator.log", "agent-node-1.log"):
        log_text = (stack.config.workdir / name).read_text()
        assert "Forbidden" not in log_text and " 403" not in log_text, name

    # no registration left behind for any deleted VM
    vm_names = {v["metadata"]["name"] for v in await stack.vms()}
    assert {r.name for r in stack.runners()} <= vm_names

    # the remaining VM's Secret is owned by it (controller) and goes with it
    (vm,) = await stack.vms()
    kube = stack.kube
    assert kube is not None
    sname = vm["spec"]["runnerConfigSecret"]
    sec = await kube.get(Secret, sname, namespace=NAMESPACE)
    (owner,) = sec.metadata.ownerReferences  # type: ignore[union-attr]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "ImpVM",
        vm["metadata"]["name"],
        vm["metadata"]["uid"],
        True,
    )
    # the agent got every JIT config from the operator's hand-out, and its identity cannot read
    # that Secret (nor the App Secret) itself
    assert "handed to the agent of node-1" in (stack.config.workdir / "operator.log").read_text()
    agent_kube = AsyncClient(config=KubeConfig.from_file(str(stack.kubeconfigs["agent"])))
    try:
        for name in (sname, CREDENTIALS_SECRET):
            with pytest.raises(ApiError) as refused:
                await agent_kube.get(Secret, name, namespace=NAMESPACE)
            assert refused.value.status.code == 403
    finally:
        await agent_kube.close()

    # secrets appear nowhere but in the VM's Secret (and the guest)
    assert rec.jit_configs and rec.session_tokens
    secrets = set(rec.jit_configs) | set(rec.session_tokens)
    secrets |= set(stack.standin.state.tokens)  # type: ignore[union-attr]
    key_lines = [ln for ln in stack.private_key_pem.splitlines() if len(ln) > 40]
    haystack = [stack.logs()]
    # the agent's hand-out token file is the one new file the channel adds
    haystack += [p.read_text() for p in stack.config.workdir.glob("*.token")]
    haystack += [repr(v) for v in await stack.vms()]
    haystack += [repr(e.to_dict()) async for e in kube.list(Event, namespace=NAMESPACE)]
    haystack.append(repr(await stack.pool_status()))
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{stack.operator_http_port}/metrics")).text
        health = await http.get(f"http://127.0.0.1:{stack.operator_http_port}/healthz")
    assert health.status_code == 200
    assert 'impvm_pool_vms{namespace="default",pool="ci-pool",state="idle"} 1.0' in metrics
    assert "impvm_github_api_calls_total" in metrics and "impvm_vms_created_total" in metrics
    haystack.append(metrics)
    text = "\n".join(haystack)
    for s in [*secrets, *key_lines]:
        assert s not in text


def _pool_is(stack: Stack, idle: int, busy: int, total: int) -> Any:
    async def check() -> bool:
        return await pool_counts(stack) == (idle, busy, total)

    return check


async def test_deleting_a_vm_collects_its_secret(stack: Stack) -> None:
    """The JIT Secret is owned by its VM and garbage-collected with it (real GC)."""
    kube = stack.kube
    assert kube is not None

    async def vm_with_secret() -> dict[str, Any] | None:
        for v in await stack.vms():
            if v["spec"].get("runnerConfigSecret"):
                return v
        return None

    vm = await wait_for("a VM with its Secret", vm_with_secret, 120, stack)
    sname = vm["spec"]["runnerConfigSecret"]
    from impvm.api.resources import ImpVMResource

    await kube.delete(ImpVMResource, vm["metadata"]["name"], namespace=NAMESPACE)

    async def secret_gone() -> bool:
        names = [s.metadata.name async for s in kube.list(Secret, namespace=NAMESPACE)]
        return sname not in names

    await wait_for("the VM's Secret collected", secret_gone, 60, stack)


async def test_lost_agent_releases_its_vms_and_pool_deletion_removes_registrations(
    stack: Stack,
) -> None:
    """The agent dies: its VMs are failed (NodeLost) and their deletion is not blocked by its
    finalizer; a new agent takes over. Then the pool is deleted: VMs go (garbage collector) and
    no registration is left."""
    from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource

    async def one_idle() -> bool:
        st = await stack.pool_status()
        return st.get("idle") == 1 and st.get("total") == 1

    await wait_for("one idle runner", one_idle, 120, stack)
    (old,) = await stack.vms()
    assert old["spec"]["nodeName"] == "node-1"
    stack.kill("agent-node-1")  # SIGKILL: no cleanup, finalizer stays, Lease stops renewing
    stack.start_agent("node-2")

    async def replaced_on_node_2() -> bool:
        vms = await stack.vms()
        names = {v["metadata"]["name"] for v in vms}
        return old["metadata"]["name"] not in names and any(
            v["spec"].get("nodeName") == "node-2"
            and (v.get("status") or {}).get("runner", {}).get("online")
            for v in vms
        )

    # lease duration 40 s + grace 5 s, then a pass
    await wait_for("VM of the lost node replaced on node-2", replaced_on_node_2, 150, stack)

    # node-1's agent comes back: it removes what its killed run left for the released VM
    stale_dir = stack.config.workdir / "agent-node-1" / "vms"
    assert any(stale_dir.iterdir())
    stack.start_agent("node-1")

    async def swept() -> bool:
        return not any(stale_dir.iterdir())

    await wait_for("stale VM state swept by the restarted agent", swept, 60, stack)

    kube = stack.kube
    assert kube is not None
    await kube.delete(ImpVMRunnerPoolResource, "ci-pool", namespace=NAMESPACE)

    async def all_gone() -> bool:
        vms = [o async for o in kube.list(ImpVMResource, namespace=NAMESPACE)]
        return not vms and not stack.runners()

    await wait_for("pool's VMs and registrations gone", all_gone, 90, stack)


async def test_a_template_edit_replaces_the_idle_vm(stack: Stack) -> None:
    """Edit the template while the runner idles: the operator (woken by the template's watch)
    counts the VM outdated, makes a replacement from the edited template, and removes the old
    VM once the new runner is online; the pool ends at minIdle with nothing outdated."""
    from lightkube.types import PatchType

    from impvm.api.resources import ImpVMTemplateResource

    kube = stack.kube
    assert kube is not None
    await wait_for("one idle runner", _pool_is(stack, 1, 0, 1), 120, stack)
    (old,) = await stack.vms()
    assert not old["spec"].get("expireAfter")
    await kube.patch(
        ImpVMTemplateResource,
        "gh-runner",
        {"spec": {"expireAfter": "2h"}},
        namespace=NAMESPACE,
        patch_type=PatchType.MERGE,
    )

    async def replaced() -> bool:
        vms = live(await stack.vms())
        st = await stack.pool_status()
        return (
            [v["metadata"]["name"] for v in vms] != [old["metadata"]["name"]]
            and len(vms) == 1
            and vms[0]["spec"].get("expireAfter") == "2h"
            and (st.get("idle"), st.get("outdated")) == (1, 0)
        )

    await wait_for("the idle VM replaced from the edited template", replaced, 180, stack)
    log_text = (stack.config.workdir / "operator.log").read_text()
    assert "pass failed" not in log_text
