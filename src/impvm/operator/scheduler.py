"""The operator's placement loop (:class:`Scheduler`): binds each unbound ImpVM to a node, as
kube-scheduler binds pods. The decision is :func:`impvm.scaling.placement.place`; this module
observes and writes.

One loop per operator process, run by the leader only, so two placements never count the same
free capacity: each binding it writes goes into its VM cache before the next decision. A binding
is a merge patch of ``spec.nodeName`` alone; the CRD keeps ``nodeName`` once set, so a binding
never moves a VM another write bound (422) and never overwrites what else changed on the VM.

What it watches: every ImpVM of the watched namespaces (not only the pools' VMs: an ImpVM made
by hand is placed too), at most :data:`MAX_PER_NAMESPACE` of one namespace, and, through the
operator's caches, the agents' Leases and the ImpVMClasses. It runs on any change of those and
every :data:`RESYNC_SECONDS`; a burst of changes makes one placement (:data:`BATCH_SECONDS`).
Each binding is recorded as an Event ``Scheduled`` on the VM ("bound to node <node>").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.api.models import API_VERSION
from impvm.api.resources import ImpVMResource
from impvm.api.times import utcnow
from impvm.api.vm import VM
from impvm.kube.events import EventRecorder
from impvm.kube.watchcache import Key, WatchCache
from impvm.operator.metrics import BINDINGS
from impvm.operator.sources import CachedSource
from impvm.scaling.placement import Binding, place

__all__ = ["BATCH_SECONDS", "MAX_PER_NAMESPACE", "RESYNC_SECONDS", "Scheduler"]

log = logging.getLogger("impvm.operator.scheduler")

#: Seconds between placements without a change (a safety net for a missed wake-up).
RESYNC_SECONDS = 5.0
#: Seconds a wake-up waits for more changes before placing (a pool creating VMs one after the
#: other is placed in one go).
BATCH_SECONDS = 0.02
#: The most ImpVMs of one namespace (and of all) the placement holds: a namespace that makes
#: more fills its own share, never another's.
MAX_PER_NAMESPACE = 5_000
MAX_OBJECTS = 20_000


def _parse(raw: dict[str, Any]) -> VM:
    return VM.from_body(raw)


class Scheduler:
    """Binds unbound ImpVMs while ``leading()`` (the leader election's fencing check).
    ``sources``: the operator's caches (Leases, classes; started by the caller), which also
    receive every binding written. ``namespaces``: those watched (empty: all)."""

    def __init__(
        self,
        kube: AsyncClient,
        sources: CachedSource,
        events: EventRecorder,
        namespaces: list[str] | None = None,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self.kube, self.sources, self.events, self.leading = kube, sources, events, leading
        self.caches = [
            WatchCache(
                kube,
                ImpVMResource,
                _parse,
                namespace=ns,
                max_objects=MAX_OBJECTS,
                max_per_namespace=MAX_PER_NAMESPACE,
                on_change=self._changed,
                name=f"impvms to place in {ns}",
            )
            for ns in (namespaces or ["*"])
        ]
        self._wake = asyncio.Event()

    def wake(self, *_: Any) -> None:
        """Place soon (a Lease, class or VM changed)."""
        self._wake.set()

    def _changed(self, _: Key) -> None:
        self._wake.set()

    def vms(self) -> list[VM]:
        """Every VM the placement sees."""
        return [vm for c in self.caches for vm in c.values()]

    async def run(self) -> None:
        """Watch and place until cancelled."""
        tasks = [asyncio.create_task(c.run(), name=c.name) for c in self.caches]
        try:
            for c in self.caches:
                await c.synced.wait()
            while True:
                self._wake.clear()
                try:
                    await self.place_once()
                except Exception:  # a bug or an unexpected answer: log it, place again later
                    log.exception("placement failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RESYNC_SECONDS)
                await asyncio.sleep(BATCH_SECONDS)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def place_once(self) -> int:
        """One placement: decide from the caches, write each binding. Returns how many were
        written."""
        vms = self.vms()
        if not any(not vm.node_name for vm in vms):
            return 0
        leases = await self.sources.leases()
        bindings = place(leases, utcnow(), vms, self.sources.class_sizes())
        done = 0
        for b in bindings:
            if not self.leading():
                log.warning("not binding ImpVMs: not the leader")
                break
            done += await self._bind(b)
        return done

    async def _bind(self, b: Binding) -> int:
        """Write one binding; 1 when it landed, 0 when the VM is gone or was bound meanwhile."""
        try:
            got = await self.kube.patch(
                ImpVMResource,
                b.name,
                {"spec": {"nodeName": b.node}},
                namespace=b.namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as e:
            if e.status.code in (404, 409, 422):
                log.info("ImpVM %s/%s not bound: %s", b.namespace, b.name, e.status.message)
                return 0
            raise
        raw = got.to_dict()
        for c in self.caches:
            if c.namespace in ("*", b.namespace):
                c.written(raw)
        self.sources.written(ImpVMResource, raw)
        BINDINGS.labels(b.node).inc()
        log.info("ImpVM %s/%s bound to node %s", b.namespace, b.name, b.node)
        await self.events.record(
            api_version=API_VERSION,
            kind="ImpVM",
            namespace=b.namespace,
            name=b.name,
            uid=str(raw["metadata"].get("uid") or ""),
            reason="Scheduled",
            message=f"bound to node {b.node}",
        )
        return 1
