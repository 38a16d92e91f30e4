"""The operator's HTTP endpoint (docs/architecture.md, fixed interfaces): ``GET /healthz``,
``GET /metrics`` (Prometheus text format),
``POST /webhooks/github`` and the agents' JIT config hand-out
(:mod:`impvm.operator.jithandout`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from impvm import metrics_http

WebhookHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Handler = WebhookHandler


def _healthz(leading: Callable[[], bool]) -> Handler:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok leader\n" if leading() else "ok standby\n")

    return healthz


async def _no_webhooks(_: web.Request) -> web.Response:
    return web.json_response(
        {"message": "webhook receiver not configured on this operator"}, status=404
    )


def make_app(
    webhook: WebhookHandler | None = None,
    jitconfig: Handler | None = None,
    leading: Callable[[], bool] | None = None,
) -> web.Application:
    """The aiohttp application. ``webhook`` handles ``POST /webhooks/github``; ``jitconfig``
    the agents' ``GET`` of a VM's JIT config (:data:`impvm.operator.jithandout.PATH`).
    ``GET /healthz`` is 200 on every replica that runs, leader or standby (``leading``; the
    body says which): a standby is healthy and ready, because it forwards deliveries to the
    leader and serves the hand-out, and a rolling update needs the new replica Ready while the
    old one still leads. ``GET /metrics``: :mod:`impvm.metrics_http`."""
    app = metrics_http.make_app(  # GitHub caps payloads at 25 MB
        client_max_size=25 * 1024**2, health=_healthz(leading or (lambda: True))
    )
    app.router.add_post("/webhooks/github", webhook or _no_webhooks)
    if jitconfig is not None:
        from impvm.operator.jithandout import PATH

        app.router.add_get(PATH, jitconfig)
    return app


start = metrics_http.start
