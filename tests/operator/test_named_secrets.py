"""The operator reads only the Secrets pools and templates name: a real operator process
(cluster-wide, with the chart's RBAC identity) beside a namespace holding more Secrets than any
cache bound. The other namespace's pool finds its credentials and webhook Secret, and the
operator's memory holds none of the unrelated Secrets (their values are searched for in the
process's memory itself)."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.devstack.standin import StandIn
from impvm.kube.controlplane import ControlPlane
from tests.tenants import (
    leading,
    operator_kubeconfig,
    seed_app,
    start_operator,
    tenant,
)

pytestmark = [pytest.mark.controlplane]

UNRELATED = 5_100  # more than the old cache of every Secret held (5,000)


def memory_holds(pid: int, needles: list[bytes]) -> list[bytes]:
    """The ``needles`` found in the writable memory of process ``pid`` (heap, anonymous maps:
    where Python keeps its objects)."""
    found: set[bytes] = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not fields[1].startswith("rw") or end - start > 1 << 31:
                continue
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, ValueError):
                continue
            found |= {n for n in needles if n in chunk}
    return sorted(found)


@pytest.fixture
async def akube(control_plane: ControlPlane) -> AsyncIterator[AsyncClient]:
    client = AsyncClient(config=KubeConfig.from_file(str(control_plane.kubeconfig)))
    yield client
    await client.close()


async def test_a_namespace_full_of_secrets_pushes_out_nobodys_credentials(
    control_plane: ControlPlane,
    kube: Client,
    akube: AsyncClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    team = tenant("z-team", 34001, 44001, "team-org")  # sorts after the flood
    flood = f"a-flood-{uuid.uuid4().hex[:6]}"
    marker = f"unrelated-{uuid.uuid4().hex}"
    standin = StandIn()
    await standin.start()
    seed_app(standin, team)
    await akube.create(Namespace(metadata=ObjectMeta(name=flood)))
    slots = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        value = base64.b64encode(f"{marker}-{i:05d}".encode()).decode()
        async with slots:
            await akube.create(
                Secret(metadata=ObjectMeta(name=f"s-{i:05d}", namespace=flood), data={"v": value})
            )

    op = None
    try:
        await asyncio.gather(*(one(i) for i in range(UNRELATED)))
        await team.create(akube, mode="hybrid")
        config = operator_kubeconfig(kube, control_plane.kubeconfig, tmp_path / "operator.kcfg")
        op = start_operator(config, tmp_path, standin.url, [])  # cluster-wide
        await leading(op)
        for _ in range(240):
            conds = await team.conditions(akube)
            if "CredentialsInvalid" in conds:
                break
            await asyncio.sleep(0.5)
        cond = conds["CredentialsInvalid"]
        assert cond["status"] == "False", cond  # its credentials were found, and GitHub took them
        assert "WebhookSecretMissing" not in op.log.read_text()
        # none of the unrelated Secrets was ever read: not their names, not their values
        needles = [f"{marker}-{i:05d}".encode() for i in (0, 1, 2500, UNRELATED - 1)]
        needles += [base64.b64encode(n) for n in needles]
        assert memory_holds(op.proc.pid, needles) == []
        assert memory_holds(op.proc.pid, [team.key.splitlines()[1].encode()]) != []  # it sees
    finally:
        if op is not None:
            op.stop()
        await team.delete(akube)
        await akube.delete(Namespace, flood)
        await standin.stop()
