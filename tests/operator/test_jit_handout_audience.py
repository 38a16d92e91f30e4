"""Defence in depth of the JIT config hand-out: the operator checks the audiences a TokenReview
answer names, so a TokenReview server that is not audience aware cannot make a token meant for
someone else count as an agent's."""

from __future__ import annotations

import httpx
from aiohttp import web
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig

from impvm.api.models import AGENT_LEASE_NAMESPACE
from impvm.kube.controlplane import free_port
from impvm.operator import http
from impvm.operator.jithandout import NODE_NAME_EXTRA, JitHandout

AGENT = f"system:serviceaccount:{AGENT_LEASE_NAMESPACE}:impvm-agent"
AGENTS = frozenset({AGENT})


async def test_a_review_that_does_not_name_the_operators_audience_is_not_enough() -> None:
    """Defence in depth: a TokenReview server that is not audience aware (an authentication
    webhook or an aggregated API server that ignores ``spec.audiences``; the real API server of
    our control plane never answers so) says "authenticated" for a token made for another
    audience. The hand-out checks ``status.audiences`` itself: 401, and no VM or Secret is
    read."""
    asked: list[str] = []

    async def review(request: web.Request) -> web.Response:
        asked.append(request.path)
        spec = (await request.json())["spec"]
        status = {
            "authenticated": True,
            "user": {"username": AGENT, "extra": {NODE_NAME_EXTRA: ["node-a"]}},
        }  # no "audiences": the server ignored the ones asked for
        return web.json_response(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
            | {"status": status}
        )

    async def other(request: web.Request) -> web.Response:
        asked.append(request.path)
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
        return web.json_response(body | {"reason": "NotFound", "message": "not found"}, status=404)

    api = web.Application()
    api.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", review)
    api.router.add_route("*", "/{tail:.*}", other)
    api_port, port = free_port(), free_port()
    api_runner = await http.start(api, "127.0.0.1", api_port)
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{api_port}"}}],
        "users": [{"name": "u", "user": {"token": "operator"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    client = AsyncClient(config=KubeConfig.from_dict(cfg))
    runner = await http.start(
        http.make_app(None, JitHandout(client, AGENTS).handle), "127.0.0.1", port
    )
    try:
        async with httpx.AsyncClient() as h:
            r = await h.get(
                f"http://127.0.0.1:{port}/agents/v1/namespaces/ns/impvms/vm-1/jitconfig",
                headers={"Authorization": "Bearer a-token-for-someone-else"},
            )
        assert r.status_code == 401, r.text
        assert asked == ["/apis/authentication.k8s.io/v1/tokenreviews"]  # nothing read
    finally:
        await runner.cleanup()
        await api_runner.cleanup()
        await client.close()
