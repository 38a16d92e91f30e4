"""Kubernetes Events (core/v1) for transitions a person should see (API conventions).

Messages are written by our code from fixed text plus names, ids and exit codes; callers never pass
a secret. As defence in depth, :class:`EventRecorder` truncates messages to 1 KiB.

Repeats are aggregated like client-go's event correlator: the same reason and message about the
same object within ``aggregate_seconds`` update one Event's ``count``/``lastTimestamp`` (at most
one write per ``aggregate_seconds``) instead of creating a new Event each time.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from impvm.api.times import k8s_time

log = logging.getLogger("impvm.kube.events")


@dataclass
class _Seen:
    name: str  # the Event object's name
    count: int
    written: float  # monotonic time of the last write


class EventRecorder:
    """Writes Events about objects, as ``component`` on ``host``. Failures are logged, not
    raised: an Event is a courtesy, never a reason to stop a reconcile."""

    def __init__(
        self,
        client: AsyncClient,
        component: str,
        host: str | None = None,
        aggregate_seconds: float = 60.0,
    ) -> None:
        self.client = client
        self.component = component
        self.host = host
        self.aggregate_seconds = aggregate_seconds
        self._seen: dict[tuple[str, ...], _Seen] = {}

    async def record(
        self,
        *,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        uid: str,
        reason: str,
        message: str,
        warning: bool = False,
    ) -> None:
        """Record one Event (type Normal or Warning) about the object; a repeat of a recent
        one increments its count instead (see the module docstring)."""
        key = (namespace, kind, name, uid, reason, message[:1024])
        seen = self._seen.get(key)
        now_m = time.monotonic()
        now = dt.datetime.now(dt.UTC)
        if seen is not None and now_m - seen.written < 10 * self.aggregate_seconds:
            seen.count += 1
            if now_m - seen.written < self.aggregate_seconds:
                return  # within the window: counted, written later
            try:
                await self.client.patch(
                    Event,
                    seen.name,
                    {"count": seen.count, "lastTimestamp": k8s_time(now)},
                    namespace=namespace,
                    patch_type=PatchType.MERGE,
                )
                seen.written = now_m
                return
            except ApiError:
                pass  # the Event expired or was deleted: create a new one
        ev = Event(
            metadata=ObjectMeta(generateName=f"{name}.", namespace=namespace),
            involvedObject=ObjectReference(
                apiVersion=api_version, kind=kind, name=name, namespace=namespace, uid=uid
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=EventSource(component=self.component, host=self.host),
            firstTimestamp=now,
            lastTimestamp=now,
            count=1,
            reportingComponent=self.component,
            reportingInstance=self.host or self.component,
        )
        try:
            created = await self.client.create(ev)
            if created.metadata and created.metadata.name:
                if len(self._seen) > 4096:  # bounded memory
                    self._seen.clear()
                self._seen[key] = _Seen(created.metadata.name, 1, now_m)
        except ApiError as e:
            log.warning("could not record event %s on %s/%s: %s", reason, namespace, name, e)
        log.info("%s %s/%s: %s: %s", kind, namespace, name, reason, message[:1024])
