"""``impvm operator``: kopf (pool controller) plus the HTTP endpoint, in one event loop.

With leader election (the default) every replica serves HTTP at once (``/healthz``, metrics,
the JIT config hand-out; a standby forwards webhook deliveries to the leader) but only the
leader runs kopf (pool passes, mints, reaper, pool deletion) and the placement of unbound
ImpVMs (:mod:`impvm.operator.scheduler`). A replica that loses the Lease
exits at once (:mod:`impvm.operator.leader`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid

import kopf
from lightkube import AsyncClient

import impvm.operator.handlers  # noqa: F401 - registers the kopf handlers
from impvm.operator import http
from impvm.operator.context import OperatorContext, OperatorSettings
from impvm.operator.jithandout import JitHandout
from impvm.operator.leader import LeaderElector, Timing
from impvm.operator.standby import LeaderGate
from impvm.operator.webhooks import WebhookReceiver

log = logging.getLogger("impvm.operator")


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
    elector: LeaderElector | None = None
    webhook: http.WebhookHandler = WebhookReceiver(ctx).handle
    gate: LeaderGate | None = None
    placement: asyncio.Task[None] | None = None
    if settings.leader_elect:
        lease = settings.leader_lease_seconds
        elector = LeaderElector(
            kube,
            settings.lease_namespace,
            settings.leader_lease_name,
            f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
            url=settings.advertise_url,
            timing=Timing(lease, lease * 2 / 3, lease / 7.5),  # client-go's 15/10/2
        )
        ctx.leading = elector.leading
        gate = LeaderGate(
            webhook,
            elector.leading,
            lambda: elector.leader_url if elector else "",
            settle=elector.settle,
        )
        webhook = gate.handle
    app = http.make_app(webhook, handout.handle, ctx.leading)
    runner = await http.start(app, http_host, http_port)
    log.info("HTTP on %s:%d", http_host, http_port)
    try:
        if elector is not None:
            log.info(
                "standby: waiting for Lease %s/%s",
                settings.lease_namespace,
                settings.leader_lease_name,
            )
            await elector.acquire()
        # pool passes read from watch caches: started (first lists under way) before kopf
        # starts the pools' daemons; a pass waits for the first lists it reads
        await ctx.use_caches(namespaces).start()
        assert ctx.scheduler is not None
        placement = asyncio.create_task(ctx.scheduler.run(), name="placement")
        work = asyncio.create_task(
            kopf.operator(
                clusterwide=not namespaces,
                namespaces=namespaces,
                standalone=True,
                memo=kopf.Memo(ctx=ctx),
            )
        )
        if elector is None:
            await asyncio.wait({work, placement}, return_when=asyncio.FIRST_COMPLETED)
            _placement_ended(placement)
            await work
            return
        hold = asyncio.create_task(elector.hold())
        await asyncio.wait({work, hold, placement}, return_when=asyncio.FIRST_COMPLETED)
        _placement_ended(placement)
        if hold.done():
            # Stop all work at once, as kube-controller-manager does: a new leader may start
            # any moment now. Mints are fenced already (ctx.leading is False).
            log.error("lost the leader Lease: exiting")
            logging.shutdown()
            os._exit(1)
        hold.cancel()
        await work
    finally:
        if placement is not None:
            placement.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await placement
        if elector is not None:
            await elector.release()
        await runner.cleanup()
        if gate is not None:
            await gate.close()
        await ctx.close()
        await kube.close()


def _placement_ended(placement: asyncio.Task[None]) -> None:
    """A placement loop that ended (it never returns; a failure it could not survive) would
    leave a leader that binds nothing: exit, as on a lost Lease, so a replica that can place
    takes over (the process supervisor restarts this one)."""
    if not placement.done():
        return
    exc = None if placement.cancelled() else placement.exception()
    log.error("the placement of ImpVMs ended (%r): exiting", exc)
    logging.shutdown()
    os._exit(1)


def main(namespaces: list[str], http_host: str, http_port: int, settings: OperatorSettings) -> None:
    """Blocking entry point of the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(run(namespaces, http_host, http_port, settings))
