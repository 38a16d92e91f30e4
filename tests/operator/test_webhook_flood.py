"""A flood of large and forged webhook deliveries against a real operator process
(``impvm operator``, leader election on) never costs the leader its Lease: bodies over the limit
are refused on their ``Content-Length`` (or, chunked, the moment they pass it) without being
read, and the webhook secret of 150 pools is hashed once per delivery, off the event loop that
renews the Lease. The Lease keeps its holder and keeps being renewed well within the renew
deadline throughout, and every refusal is counted in ``impvm_webhook_requests_total``.

(How much memory the flood costs is measured by ``benchmarks/webhook_flood.py``, not here.)"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.api.models import AGENT_LEASE_NAMESPACE, WEBHOOK_SECRET_KEY
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import app_secret, pool_manifest
from impvm.devstack.standin import StandIn
from impvm.github.webhooks import compute_signature
from impvm.kube.controlplane import ControlPlane
from tests.tenants import (
    BASE_IMAGE,
    CREDENTIALS,
    RUNNER_LAYER,
    TEMPLATE,
    WEBHOOK,
    leading,
    seed_app,
    start_operator,
    tenant,
)

pytestmark = [pytest.mark.controlplane]

POOLS = 150
LEASE_SECONDS = 15.0  # the default: renewed every 2 s, given up 10 s after the last renewal
RENEW_DEADLINE = LEASE_SECONDS * 2 / 3
BIG = 24 * 1024**2  # under GitHub's 25 MB cap


def metric(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
async def kube(control_plane: ControlPlane) -> AsyncIterator[AsyncClient]:
    client = AsyncClient(config=KubeConfig.from_file(str(control_plane.kubeconfig)))
    yield client
    await client.close()


async def test_a_flood_of_large_forged_deliveries_never_costs_the_leader_its_lease(
    control_plane: ControlPlane, kube: AsyncClient, tmp_path: Path
) -> None:
    t = tenant("flood", 33001, 43001, "flood-org")
    standin = StandIn()
    await standin.start()
    seed_app(standin, t)
    await kube.create(Namespace(metadata=ObjectMeta(name=t.ns)))
    try:
        await kube.create(
            ImpVMClassResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMClass",
                    "metadata": {"name": f"cls-{t.ns}"},
                    "spec": {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1},
                }
            )
        )
        await kube.create(
            ImpVMTemplateResource.from_dict(
                {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": "ImpVMTemplate",
                    "metadata": {"name": TEMPLATE, "namespace": t.ns},
                    "spec": {
                        "classRef": {"name": f"cls-{t.ns}"},
                        "image": BASE_IMAGE,
                        "runnerLayer": RUNNER_LAYER,
                    },
                }
            )
        )
        await kube.create(app_secret(CREDENTIALS, t.ns, t.app_id, t.installation_id, t.key))
        hook = base64.b64encode(t.webhook_secret.encode()).decode()
        await kube.create(
            Secret(
                metadata=ObjectMeta(name=WEBHOOK, namespace=t.ns), data={WEBHOOK_SECRET_KEY: hook}
            )
        )
        scaling = {
            "mode": "webhook",
            "minIdle": 0,
            "maxConcurrent": 1,
            "scaleUpStep": 1,
            "cooldownSeconds": 0,
            "webhook": {"secretRef": {"name": WEBHOOK}},
        }
        for i in range(POOLS):
            body = pool_manifest(
                f"p{i}",
                t.ns,
                scaling,
                template=TEMPLATE,
                org=t.org,
                credentials_secret=CREDENTIALS,
            )
            await kube.create(ImpVMRunnerPoolResource.from_dict(body))
        op = start_operator(
            control_plane.kubeconfig,
            tmp_path,
            standin.url,
            [t.ns],
            "--leader-lease-seconds",
            str(LEASE_SECONDS),
        )
        try:
            await leading(op)
            await _every_pool_registered(kube, t.ns, op)
            await _flood_while_watching(kube, op.url, t.webhook_secret, op.alive)
        finally:
            op.stop()
    finally:
        await kube.delete(ImpVMClassResource, f"cls-{t.ns}")
        await kube.delete(Namespace, t.ns)
        await standin.stop()


async def _every_pool_registered(kube: AsyncClient, ns: str, op: object) -> None:
    """Every pool had a pass (its status written: its webhook secret is known)."""
    for _ in range(900):
        done = [
            p
            async for p in kube.list(ImpVMRunnerPoolResource, namespace=ns)
            if (p.to_dict().get("status") or {}).get("observedGeneration")
        ]
        if len(done) == POOLS:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"only {len(done)} of {POOLS} pools had a pass")


def _ping(secret: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1}).encode()
    return body, {
        "X-GitHub-Event": "ping",
        "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": compute_signature(secret, body),
        "Content-Type": "application/json",
    }


async def _flood_while_watching(kube: AsyncClient, url: str, secret: str, alive: object) -> None:
    hook = f"{url}/webhooks/github"
    async with httpx.AsyncClient(timeout=120) as http:
        body, headers = _ping(secret)
        assert (await http.post(hook, content=body, headers=headers)).status_code == 202
        before = (await http.get(f"{url}/metrics")).text
    lease = await kube.get(Lease, "impvm-operator", namespace=AGENT_LEASE_NAMESPACE)
    assert lease.spec is not None
    holder = lease.spec.holderIdentity
    renewals: list[dt.datetime] = []
    stop = asyncio.Event()

    async def alive_throughout() -> None:
        while not stop.is_set():
            assert callable(alive) and alive(), "the leader exited (it lost its Lease)"
            await asyncio.sleep(0.2)

    async def renewed() -> None:
        # every renewal arrives as a watch event, however busy this test's loop is
        version = lease.metadata.resourceVersion if lease.metadata else None
        async for _, got in kube.watch(
            Lease,
            namespace=AGENT_LEASE_NAMESPACE,
            fields={"metadata.name": "impvm-operator"},
            resource_version=version,
        ):
            assert got.spec is not None
            assert got.spec.holderIdentity == holder, "the Lease changed hands"
            if got.spec.renewTime is not None:
                renewals.append(got.spec.renewTime)

    async def watch() -> None:
        tasks = {asyncio.create_task(renewed()), asyncio.create_task(alive_throughout())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # an AssertionError of either ends the test
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    big = b"x" * BIG
    forged = {"X-GitHub-Event": "workflow_job", "X-Hub-Signature-256": "sha256=" + "0" * 64}
    answers: list[int | str] = []
    slots = asyncio.Semaphore(16)

    async def send(content: object, extra: dict[str, str] | None = None) -> None:
        async with slots, httpx.AsyncClient(timeout=120) as h:
            try:
                r = await h.post(hook, content=content, headers={**forged, **(extra or {})})  # type: ignore[arg-type]
                answers.append(r.status_code)
            except httpx.TransportError as e:  # refused while we were still sending
                answers.append(type(e).__name__)

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(BIG // 65536):
            yield big[:65536]

    async def flood() -> None:
        sends = [send(big) for _ in range(32)]  # with Content-Length
        sends += [send(chunked()) for _ in range(8)]  # chunked: counted as it streams
        sends += [send(b"{" + b" " * (1024**2 - 2) + b"}") for _ in range(32)]  # under the limit
        sends += [send(b"x" * (26 * 1024**2))]  # over GitHub's cap too
        await asyncio.gather(*sends)
        # and the Lease is still renewed afterwards: a Lease's worth of renewals (every 2 s)
        after = len(renewals) + int(LEASE_SECONDS // 2)
        deadline = time.monotonic() + 4 * LEASE_SECONDS
        while len(renewals) < after and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    flooding = asyncio.create_task(flood())
    try:
        await asyncio.wait({watcher, flooding}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done():
            watcher.result()  # the Lease changed hands or the leader exited: fail now
        await flooding
    finally:
        stop.set()
        flooding.cancel()
        await asyncio.gather(watcher, flooding, return_exceptions=True)
    # refused, never read: 413 (or the connection closed on a body still being sent)
    refused = [a for a in answers if a != 401]
    assert len(answers) == 73 and answers.count(401) == 32, answers
    assert all(a == 413 or isinstance(a, str) for a in refused), answers
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(renewals)]
    assert len(renewals) >= int(LEASE_SECONDS // 2) and max(gaps) < RENEW_DEADLINE, gaps
    async with httpx.AsyncClient(timeout=30) as http:
        body, headers = _ping(secret)
        assert (await http.post(hook, content=body, headers=headers)).status_code == 202
        after = (await http.get(f"{url}/metrics")).text
    counted = metric(after, "impvm_webhook_requests_total", 'status="413"') - metric(
        before, "impvm_webhook_requests_total", 'status="413"'
    )
    assert counted == len(refused) and counted > 0
