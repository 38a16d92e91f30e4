"""The operator's webhook receiver over real HTTP: deliveries verified per pool, parsed by
:func:`impvm.github.webhooks.handle_delivery` (its metric moves), and bounded memory for jobs
that match no pool."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from prometheus_client import REGISTRY

from impvm.devstack.standin.state import StandInState
from impvm.github.webhooks import compute_signature
from impvm.kube.controlplane import ControlPlane, free_port
from impvm.operator import http as operator_http
from impvm.operator.context import OperatorContext
from impvm.operator.webhooks import WebhookReceiver
from impvm.scaling.jobs import PoolScope
from impvm.scaling.labels import PoolLabels
from impvm.scaling.poolpass import PoolMemory, PoolRoute

pytestmark = [pytest.mark.controlplane]

SECRET = "hook-secret-for-tests"


@pytest.fixture
async def receiver(control_plane: ControlPlane) -> AsyncIterator[tuple[WebhookReceiver, str]]:
    kube = AsyncClient(config=KubeConfig.from_file(str(control_plane.kubeconfig)))
    ctx = OperatorContext(kube)
    scope = PoolScope(
        PoolLabels(namespace="ns", name="small", labels=("imp",)),
        org="octo",
        installation="gh#installation/1",
        installation_id=1,
    )
    ctx.pool(("ns", "small")).memory = PoolMemory(
        route=PoolRoute(scope=scope, webhook_secret=SECRET)
    )
    rx = WebhookReceiver(ctx, max_remembered=10)
    port = free_port()
    runner = await operator_http.start(operator_http.make_app(rx.handle), "127.0.0.1", port)
    try:
        yield rx, f"http://127.0.0.1:{port}/webhooks/github"
    finally:
        await runner.cleanup()
        await ctx.close()
        await kube.close()


def delivery(state: StandInState, labels: list[str]) -> tuple[bytes, dict[str, str]]:
    job = state.queue_job("octo/app", labels)
    body = json.dumps(state.workflow_job_payload("queued", job, 1)).encode()
    headers = {
        "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": compute_signature(SECRET, body),
        "Content-Type": "application/json",
    }
    return body, headers


def deliveries_counted(result: str) -> float:
    value = REGISTRY.get_sample_value(
        "impvm_github_webhook_deliveries_total", {"event": "workflow_job", "result": result}
    )
    return value or 0.0


async def test_unmatched_jobs_are_remembered_in_bounded_memory(
    receiver: tuple[WebhookReceiver, str],
) -> None:
    rx, url = receiver
    state = StandInState()
    accepted = deliveries_counted("accepted")
    async with httpx.AsyncClient() as http:
        for _ in range(30):
            body, headers = delivery(state, ["self-hosted", "gpu"])  # no pool has gpu
            assert (await http.post(url, content=body, headers=headers)).status_code == 202
        body, headers = delivery(state, ["self-hosted", "imp"])
        assert (await http.post(url, content=body, headers=headers)).status_code == 202
        forged = dict(headers, **{"X-Hub-Signature-256": compute_signature("other", body)})
        assert (await http.post(url, content=body, headers=forged)).status_code == 401
    assert len(rx._logged_unmatched) == 10
    assert deliveries_counted("accepted") == accepted + 31
    scope = rx.ctx.pool(("ns", "small")).scope
    table = rx.ctx.jobs_of(("ns", "small"))
    assert scope is not None and table is not None
    assert table.pending(scope.key, rx.ctx.scopes()) == 1
