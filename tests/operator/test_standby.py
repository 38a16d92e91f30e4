"""A standby's webhook gate, with real HTTP servers on loopback: the leader handles a delivery
itself; a standby forwards it unchanged to the leader's URL and relays the answer; no leader, an
unreachable leader or a second hop is 503."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from lightkube.resources.coordination_v1 import Lease

from impvm.kube.controlplane import free_port
from impvm.operator import http
from impvm.operator.leader import LeaderElector, Timing
from impvm.operator.standby import FORWARDED_HEADER, LeaderGate

T = Timing(lease_duration=15, renew_deadline=10, retry_period=2)

HEADERS = {
    "X-GitHub-Event": "workflow_job",
    "X-GitHub-Delivery": "d-1",
    "X-Hub-Signature-256": "sha256=" + "0" * 64,
    "Content-Type": "application/json",
}


class Receiver:
    def __init__(self) -> None:
        self.seen: list[tuple[bytes, dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((await http.body_of(request), dict(request.headers)))
        return web.json_response({"message": "accepted"}, status=202)


async def _serve(handler: Any) -> tuple[web.AppRunner, int]:
    port = free_port()
    return await http.start(http.make_app(handler), "127.0.0.1", port), port


@pytest.fixture
async def leader() -> AsyncIterator[tuple[Receiver, str]]:
    rx = Receiver()
    runner, port = await _serve(rx.handle)
    yield rx, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _post(port: int, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient() as h:
        return await h.post(
            f"http://127.0.0.1:{port}/webhooks/github",
            content=b'{"action":"queued"}',
            headers=headers or HEADERS,
        )


async def test_standby_forwards_and_leader_handles(leader: tuple[Receiver, str]) -> None:
    rx, url = leader
    mine = Receiver()
    state = {"leading": False}
    gate = LeaderGate(mine.handle, lambda: state["leading"], lambda: url)
    runner, port = await _serve(gate.handle)
    try:
        r = await _post(port)
        assert r.status_code == 202 and r.json() == {"message": "accepted"}
        ((body, headers),) = rx.seen
        assert body == b'{"action":"queued"}' and not mine.seen
        for k, v in HEADERS.items():
            assert headers[k] == v
        assert headers[FORWARDED_HEADER] == "1"
        state["leading"] = True
        assert (await _post(port)).status_code == 202 and len(mine.seen) == 1
        assert len(rx.seen) == 1
    finally:
        await runner.cleanup()
        await gate.close()


@pytest.mark.parametrize("case", ["no leader", "unreachable", "second hop"])
async def test_standby_answers_503_when_it_cannot_forward(
    leader: tuple[Receiver, str], case: str
) -> None:
    rx, url = leader
    target = {"no leader": "", "unreachable": f"http://127.0.0.1:{free_port()}"}.get(case, url)
    gate = LeaderGate(Receiver().handle, lambda: False, lambda: target)
    runner, port = await _serve(gate.handle)
    try:
        headers = {**HEADERS, FORWARDED_HEADER: "1"} if case == "second hop" else HEADERS
        r = await _post(port, headers)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert not rx.seen
    finally:
        await runner.cleanup()
        await gate.close()


@pytest.mark.controlplane
async def test_a_replica_that_has_not_read_the_lease_yet_waits_and_forwards(
    leader: tuple[Receiver, str], akube: Any
) -> None:
    """A replica serves HTTP before its first read of the Lease: a delivery arriving in
    between waits for that read and is forwarded to the leader it names, not refused."""
    rx, url = leader
    name = f"settle-{uuid.uuid4().hex[:8]}"
    holder = LeaderElector(akube, "default", name, "holder", url=url, timing=T)
    late = LeaderElector(akube, "default", name, "late", url="http://late", timing=T)
    await holder.acquire()
    gate = LeaderGate(Receiver().handle, late.leading, lambda: late.leader_url, settle=late.settle)
    runner, port = await _serve(gate.handle)
    try:
        post = asyncio.create_task(_post(port))
        await asyncio.sleep(0)  # the delivery is in; the replica then reads the Lease
        while not rx.seen and not post.done():
            await late.step()
            await asyncio.wait({post}, timeout=0.2)
        r = await post
        assert r.status_code == 202 and len(rx.seen) == 1, r.text
        assert not late.leading()
    finally:
        await runner.cleanup()
        await gate.close()
        await akube.delete(Lease, name, namespace="default")


@pytest.mark.controlplane
async def test_a_replica_that_never_learns_a_leader_refuses_after_settling(akube: Any) -> None:
    late = LeaderElector(akube, "default", f"none-{uuid.uuid4().hex[:8]}", "late", timing=T)
    gate = LeaderGate(
        Receiver().handle,
        late.leading,
        lambda: late.leader_url,
        settle=late.settle,
        settle_seconds=0.3,
    )
    runner, port = await _serve(gate.handle)
    try:
        r = await _post(port)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    finally:
        await runner.cleanup()
        await gate.close()
