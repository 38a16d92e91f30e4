"""``impvm operator``: kopf (pool controller) plus the HTTP endpoint, in one event loop."""

from __future__ import annotations

import asyncio
import logging

import kopf
from lightkube import AsyncClient

import impvm.operator.handlers  # noqa: F401 - registers the kopf handlers
from impvm.operator import http
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.jithandout import JitHandout
from impvm.operator.webhooks import WebhookReceiver


async def run(
    namespaces: list[str],
    http_host: str,
    http_port: int,
    settings: OperatorSettings,
) -> None:
    """Run until cancelled. ``namespaces`` empty = cluster-wide. Kubernetes credentials come
    from ``KUBECONFIG`` or the in-cluster ServiceAccount (kopf's and lightkube's discovery)."""
    kube = AsyncClient(field_manager="impvm-operator")
    ctx = OperatorContext(kube, settings)
    handout = JitHandout(kube, frozenset(settings.agent_service_accounts))
    app = http.make_app(WebhookReceiver(ctx).handle, handout.handle)
    runner = await http.start(app, http_host, http_port)
    logging.getLogger("impvm.operator").info("HTTP on %s:%d", http_host, http_port)
    try:
        await kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,
            memo=kopf.Memo(ctx=ctx),
        )
    finally:
        await runner.cleanup()
        await ctx.close()
        await kube.close()


def main(namespaces: list[str], http_host: str, http_port: int, settings: OperatorSettings) -> None:
    """Blocking entry point of the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(run(namespaces, http_host, http_port, settings))
