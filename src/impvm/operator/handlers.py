"""kopf handlers: thin. Each gathers what kopf hands it and calls the domain code.

- one daemon per pool runs :class:`~impvm.operator.pool.PoolReconciler` passes, serialised per
  pool (one loop per pool), woken early by webhooks and by what the operator's watch caches
  see change (:mod:`impvm.operator.sources`: its VMs, its own object, its template or class, as
  a template edit makes its idle VMs outdated). kopf itself watches only the pools: ImpVMs,
  templates and classes have no kopf handler, so kopf keeps no per-object state for 2,000 VMs;
- pool deletion deregisters the pool's idle runners before the garbage collector removes its VMs;
- pools with ``spec.reaper.enabled`` get a reaper daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from impvm.api.models import GROUP, VERSION, PoolKey
from impvm.operator.context import OperatorContext
from impvm.operator.metrics import forget_pool
from impvm.operator.pool import PoolReconciler
from impvm.operator.reaper import reaper_enabled, reaper_loop
from impvm.operator.teardown import deregister_pool_runners

log = logging.getLogger("impvm.operator")

#: Seconds before a failed pass is retried (exceptions other than GitHub's, e.g. API conflicts).
ERROR_RETRY_SECONDS = 5.0


def _ctx(memo: Any) -> OperatorContext:
    ctx = memo.get("ctx")
    assert isinstance(ctx, OperatorContext), "operator started without context"
    return ctx


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf settings: our own finalizer and annotation names, quiet event posting."""
    settings.persistence.finalizer = "imp.dev/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="operator.imp.dev"
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.imp.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


@kopf.daemon(GROUP, VERSION, "impvmrunnerpools", cancellation_timeout=2.0)
async def pool_daemon(
    name: str, namespace: str | None, uid: str | None, memo: Any, **_: Any
) -> None:
    """Reconcile one pool until it is deleted: a pass, then wait for a wake-up or the delay the
    pass asked for."""
    ctx = _ctx(memo)
    key = PoolKey(namespace or "", name)
    slot = ctx.pool(key)
    reconciler = PoolReconciler(ctx)
    while True:
        slot.wake.clear()
        try:
            delay = await reconciler.reconcile(key, uid)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed pass is retried; messages carry no secrets
            log.warning("pool %s/%s: pass failed: %s: %s", namespace, name, type(e).__name__, e)
            delay = ERROR_RETRY_SECONDS
        if delay is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.wake.wait(), delay)


@kopf.on.delete(GROUP, VERSION, "impvmrunnerpools", retries=30)
async def pool_deleted(name: str, namespace: str | None, body: Any, memo: Any, **_: Any) -> None:
    """Deregister the pool's runners that are not busy before its VMs go (no leaked
    registrations). Busy runners are retried every 10 s, at most 30 times, then left to GitHub."""
    ctx = _ctx(memo)
    busy = await deregister_pool_runners(ctx, body)
    key = PoolKey(namespace or "", name)
    ctx.forget(key)
    forget_pool(key)
    if busy:
        raise kopf.TemporaryError(f"{busy} runner(s) still busy; retrying", delay=10)


@kopf.daemon(GROUP, VERSION, "impvmrunnerpools", cancellation_timeout=2.0, when=reaper_enabled)
async def reaper_daemon(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Reaper passes for one pool with ``spec.reaper.enabled``: one loop per pool, so passes of a
    pool never run concurrently; stopped by kopf when the reaper is disabled."""
    await reaper_loop(_ctx(memo), PoolKey(namespace or "", name))
