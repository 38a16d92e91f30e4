"""The operator's HTTP endpoint (docs/architecture.md, fixed interfaces): ``GET /healthz``,
``GET /metrics`` (Prometheus text format) and ``POST /webhooks/github``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from impvm import metrics_http

WebhookHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _no_webhooks(_: web.Request) -> web.Response:
    return web.json_response(
        {"message": "webhook receiver not configured on this operator"}, status=404
    )


def make_app(webhook: WebhookHandler | None = None) -> web.Application:
    """The aiohttp application. ``webhook`` handles ``POST /webhooks/github``."""
    app = metrics_http.make_app(client_max_size=25 * 1024**2)  # GitHub caps payloads at 25 MB
    app.router.add_post("/webhooks/github", webhook or _no_webhooks)
    return app


start = metrics_http.start
