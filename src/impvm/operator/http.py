"""The operator's HTTP endpoint (docs/architecture.md, fixed interfaces): ``GET /healthz``,
``GET /metrics`` (Prometheus text format) and ``POST /webhooks/github``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

WebhookHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _metrics(_: web.Request) -> web.Response:
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _no_webhooks(_: web.Request) -> web.Response:
    return web.json_response(
        {"message": "webhook receiver not configured on this operator"}, status=404
    )


def make_app(webhook: WebhookHandler | None = None) -> web.Application:
    """The aiohttp application. ``webhook`` handles ``POST /webhooks/github``."""
    app = web.Application(client_max_size=25 * 1024 * 1024)  # GitHub caps payloads at 25 MB
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/webhooks/github", webhook or _no_webhooks)
    return app


async def start(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` on ``host:port``; return the runner (``await runner.cleanup()`` to stop)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
