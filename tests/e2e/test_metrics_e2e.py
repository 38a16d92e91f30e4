"""Every metric family moves in a real run: the embedded stack (control plane, GitHub stand-in
delivering signed webhooks, operator and agent as processes) runs jobs, the reaper judges the
pool's VMs, and both ``/metrics`` endpoints are scraped over HTTP."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from impvm.api.resources import ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig
from impvm.devstack.seed import NAMESPACE, POOL
from impvm.devstack.stack import Stack, wait_for
from impvm.github.webhooks import compute_signature
from tests.metric_families import exported_families

pytestmark = [pytest.mark.controlplane]

#: families that move only when something fails, each proven where it can be made to fail
EXEMPT = {
    # the client waited out a rate limit: tests/github/test_gh_resilience.py
    "impvm_github_rate_limit_waits_total",
}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(
        StackConfig(workdir=tmp_path / "stack", polling_interval_seconds=5, scaling_mode="hybrid")
    )
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def scrape(url: str) -> dict[str, list[Sample]]:
    """Family name -> samples (counters under their ``_total`` name)."""
    async with httpx.AsyncClient() as http:
        resp = await http.get(url)
    resp.raise_for_status()
    out: dict[str, list[Sample]] = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            base = s.name
            for suffix in ("_bucket", "_sum", "_count"):
                if fam.type == "histogram" and base.endswith(suffix):
                    base = base.removesuffix(suffix)
            out.setdefault(base, []).append(s)
    return out


def moved(samples: list[Sample], kind: str) -> bool:
    """A counter or histogram moved when some sample is above zero; a gauge when it was set."""
    if kind == "gauge":
        return bool(samples)
    return any(s.value > 0 for s in samples)


async def test_operator_and_agent_export_every_family(stack: Stack) -> None:
    async def one_idle() -> bool:
        runners = stack.runners()
        return len(runners) == 1 and runners[0].status == "online" and not runners[0].busy

    await wait_for("one idle registered runner", one_idle, 180, stack)
    kube = stack.kube
    assert kube is not None
    await kube.patch(
        ImpVMRunnerPoolResource,
        POOL,
        {"spec": {"reaper": {"enabled": True, "intervalSeconds": 10}}},
        namespace=NAMESPACE,
        patch_type=PatchType.MERGE,
    )
    # a second pool that fits the same jobs: each job fits both, and goes to the older one
    await stack.add_pool("twin", ["imp"], min_idle=0)

    async def twin_passed() -> bool:
        return "observedGeneration" in await stack.pool_status("twin")

    await wait_for("the twin pool's first pass", twin_passed, 120, stack)
    job_ids = stack.queue_jobs(2, sleep=1.0)
    stack.queue_jobs(1, labels=["self-hosted", "no-such-label"])  # matches no pool

    async def done() -> bool:
        jobs = [j for j in stack.jobs() if j.id in job_ids]
        return all(j.status == "completed" for j in jobs)

    await wait_for("2 jobs completed", done, 240, stack)

    operator_url = f"http://127.0.0.1:{stack.operator_http_port}"
    agent_url = f"http://127.0.0.1:{stack.agent_metrics_port}"
    # a forged delivery is refused and counted
    body = json.dumps({"action": "queued"}).encode()
    async with httpx.AsyncClient() as http:
        forged = await http.post(
            f"{operator_url}/webhooks/github",
            content=body,
            headers={
                "X-GitHub-Event": "workflow_job",
                "X-GitHub-Delivery": str(uuid.uuid4()),
                "X-Hub-Signature-256": compute_signature("not-the-secret", body),
            },
        )
        assert forged.status_code == 401
        assert (await http.get(f"{agent_url}/healthz")).status_code == 200

    async def reaper_judged_and_a_vm_removed() -> bool:
        # a finished VM's lifetime is observed once the API server has removed it (after the
        # agent released it), which may come after both jobs are reported completed
        got = await scrape(f"{operator_url}/metrics")
        lived = any(s.value > 0 for s in got.get("impvm_vm_lifetime_seconds", []))
        return "impvm_reaper_decisions_total" in got and lived

    await wait_for("a reaper pass and a VM removed", reaper_judged_and_a_vm_removed, 90, stack)

    operator = await scrape(f"{operator_url}/metrics")
    agent = await scrape(f"{agent_url}/metrics")
    families = exported_families()
    not_moved = []
    for name, kind in sorted(families.items()):
        if name in EXEMPT:
            continue
        samples = operator.get(name, []) + agent.get(name, [])
        if not moved(samples, kind):
            not_moved.append(name)
    assert not not_moved, not_moved

    def value(fam: dict[str, list[Sample]], name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fam.get(name, [])
            if all(s.labels.get(k) == v for k, v in labels.items())
        )

    # the running operator counts webhook deliveries: the stand-in's, and the forged one
    deliveries = "impvm_github_webhook_deliveries_total"
    assert value(operator, deliveries, event="workflow_job", result="accepted") >= 2
    assert value(operator, deliveries, event="workflow_job", result="rejected") >= 1
    assert value(operator, "impvm_jit_mints_total", pool=POOL, result="ok") >= 3
    # the agent: capacity as configured, phases it reported
    assert value(agent, "impvm_agent_capacity", node="node-1", resource="vcpu") == 16
    # three VMs ran (the idle one and two more); a VM deleted right after its job may be
    # stopped before its exit is reported, so only one Succeeded is certain
    phases = {s.labels["phase"]: s.value for s in agent.get("impvm_vm_phase_transitions_total", [])}
    assert phases.get("Scheduled", 0) >= 3 and phases.get("Running", 0) >= 3, phases
    assert phases.get("Succeeded", 0) >= 1, phases
    # labels carry no secrets (the JIT configs are in the Secrets, the key in the stack)
    text = repr(operator) + repr(agent)
    assert stack.private_key_pem.splitlines()[1] not in text
