"""The operator's placement loop (:class:`Scheduler`): binds each unbound ImpVM to a node, as
kube-scheduler binds pods. The decision is :func:`impvm.scaling.placement.place`; this module
observes and writes.

One loop per operator process, run by the leader only, so two placements never count the same
free capacity: each binding it writes goes into its VM cache before the next decision. A binding
is a merge patch of ``spec.nodeName`` and the annotation ``imp.dev/bound-size`` (the size the
node counts and starts the VM at); it carries no resourceVersion, so the pool pass's own
writes to the new VM (its JIT Secret's name) never make it conflict, and the CRD keeps
``nodeName`` once set, so a binding never moves a VM another write bound (422).

What it watches: the ImpVMs of the watched namespaces (not only the pools' VMs: an ImpVM made
by hand is placed too) in two caches, the unbound ones (field selector ``spec.nodeName=``, at
most :data:`MAX_UNBOUND_PER_NAMESPACE` of one namespace: a namespace with more waits for its
turn, the others do not) and the bound ones, whose sizes are each node's use (at most
:data:`MAX_BOUND_PER_NAMESPACE` of one namespace; a VM left out is not counted, and the node's
agent, which counts its own VMs, refuses what does not fit: ``OutOfCapacity``); through the
operator's caches, the agents' Leases and the ImpVMClasses. It runs on any change of those and
every :data:`RESYNC_SECONDS`; a burst of changes makes one placement (:data:`BATCH_SECONDS`).
Each binding is recorded, best effort as Events are, as an Event ``Scheduled`` on the VM
("bound to node <node>").

Spreading remembers the bindings of the last :data:`RECENT_WINDOW_SECONDS` per node
(:func:`impvm.scaling.placement.place`'s ``recent``), so a node that ends its VMs at once to
look empty gets its turn, not every VM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient
from lightkube import operators as op
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.api.models import API_VERSION, BOUND_SIZE_ANNOTATION
from impvm.api.resources import ImpVMResource
from impvm.api.times import utcnow
from impvm.api.vm import VM
from impvm.kube.events import EventRecorder
from impvm.kube.watchcache import Key, WatchCache
from impvm.operator.metrics import BINDINGS
from impvm.operator.sources import CachedSource
from impvm.scaling.placement import Binding, place

__all__ = [
    "BATCH_SECONDS",
    "MAX_BOUND_PER_NAMESPACE",
    "MAX_UNBOUND_PER_NAMESPACE",
    "RECENT_WINDOW_SECONDS",
    "RESYNC_SECONDS",
    "Scheduler",
]

log = logging.getLogger("impvm.operator.scheduler")

#: Seconds between placements without a change (a safety net for a missed wake-up).
RESYNC_SECONDS = 5.0
#: Seconds a wake-up waits for more changes before placing (a pool creating VMs one after the
#: other is placed in one go).
BATCH_SECONDS = 0.02
#: The most unbound ImpVMs of one namespace (and of all) the placement holds.
MAX_UNBOUND_PER_NAMESPACE = 1_000
MAX_UNBOUND = 20_000
#: The most bound ImpVMs of one namespace (and of all) the placement counts.
MAX_BOUND_PER_NAMESPACE = 5_000
MAX_BOUND = 50_000
#: Seconds a binding counts in a node's share (spreading).
RECENT_WINDOW_SECONDS = 600.0


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
        self.caches: list[WatchCache[VM]] = []
        self._bound: list[WatchCache[VM]] = []
        for ns in namespaces or ["*"]:
            for bound, selector, most, per_ns in (
                (False, "", MAX_UNBOUND, MAX_UNBOUND_PER_NAMESPACE),
                (True, op.not_equal(""), MAX_BOUND, MAX_BOUND_PER_NAMESPACE),
            ):
                cache: WatchCache[VM] = WatchCache(
                    kube,
                    ImpVMResource,
                    _parse,
                    namespace=ns,
                    fields={"spec.nodeName": selector},
                    max_objects=most,
                    max_per_namespace=per_ns,
                    on_change=self._changed,
                    name=f"{'bound' if bound else 'unbound'} impvms in {ns}",
                )
                self.caches.append(cache)
                if bound:
                    self._bound.append(cache)
        self._wake = asyncio.Event()
        #: (monotonic time, node) of the bindings of the last RECENT_WINDOW_SECONDS
        self._recent: collections.deque[tuple[float, str]] = collections.deque()

    def wake(self, *_: Any) -> None:
        """Place soon (a Lease, class or VM changed)."""
        self._wake.set()

    def _changed(self, _: Key) -> None:
        self._wake.set()

    def vms(self) -> list[VM]:
        """Every VM the placement sees (a VM bound meanwhile may be in both caches for a
        moment: the bound one wins)."""
        seen: dict[tuple[str, str], VM] = {}
        for c in self.caches:
            for vm in c.values():
                if vm.node_name or vm.key not in seen:
                    seen[vm.key] = vm
        return list(seen.values())

    def recent(self) -> dict[str, int]:
        """Node -> VMs bound there within :data:`RECENT_WINDOW_SECONDS`."""
        horizon = time.monotonic() - RECENT_WINDOW_SECONDS
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return dict(collections.Counter(node for _, node in self._recent))

    def watches(self) -> list[WatchCache[Any]]:
        """The caches :meth:`run` starts and waits for (a subclass adds its own)."""
        return list(self.caches)

    async def run(self) -> None:
        """Watch and place until cancelled."""
        watches = self.watches()
        tasks = [asyncio.create_task(c.run(), name=c.name) for c in watches]
        try:
            for c in watches:
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
        bindings = place(leases, utcnow(), vms, self.sources.class_sizes(), self.recent())
        done = 0
        for b in bindings:
            if not self.leading():
                log.warning("not binding ImpVMs: not the leader")
                break
            done += await self._bind(b)
        return done

    async def _bind(self, b: Binding, how: str = "") -> int:
        """Write one binding; 1 when it landed, 0 when the VM is gone or was bound meanwhile."""
        size = f"{b.size[0]},{b.size[1]}"
        try:
            got = await self.kube.patch(
                ImpVMResource,
                b.name,
                {
                    "metadata": {"annotations": {BOUND_SIZE_ANNOTATION: size}},
                    "spec": {"nodeName": b.node},
                },
                namespace=b.namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as e:
            if e.status.code in (404, 409, 422):
                log.info("ImpVM %s/%s not bound: %s", b.namespace, b.name, e.status.message)
                return 0
            raise
        raw = got.to_dict()
        for c in self._bound:
            if c.namespace in ("*", b.namespace):
                c.written(raw)  # the unbound cache's copy goes when its watch says so
        self.sources.written(ImpVMResource, raw)
        self._recent.append((time.monotonic(), b.node))
        BINDINGS.labels(b.node).inc()
        log.info("ImpVM %s/%s bound to node %s", b.namespace, b.name, b.node)
        await self.events.record(
            api_version=API_VERSION,
            kind="ImpVM",
            namespace=b.namespace,
            name=b.name,
            uid=str(raw["metadata"].get("uid") or ""),
            reason="Scheduled",
            message=f"bound to node {b.node}{how}",
        )
        return 1
