"""Kubernetes Events (core/v1) for transitions a person should see (API conventions).

Messages are written by our code from fixed text plus names, ids and exit codes; callers never pass
a secret. As defence in depth, :class:`EventRecorder` truncates messages to 1 KiB.
"""

from __future__ import annotations

import datetime as dt
import logging

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event

log = logging.getLogger("impvm.events")


class EventRecorder:
    """Writes Events about objects, as ``component`` on ``host``. Failures are logged, not
    raised: an Event is a courtesy, never a reason to stop a reconcile."""

    def __init__(self, client: AsyncClient, component: str, host: str | None = None) -> None:
        self.client = client
        self.component = component
        self.host = host

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
        """Create one Event (type Normal or Warning) about the object."""
        now = dt.datetime.now(dt.UTC)
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
            await self.client.create(ev)
        except ApiError as e:
            log.warning("could not record event %s on %s/%s: %s", reason, namespace, name, e)
        log.info("%s %s/%s: %s: %s", kind, namespace, name, reason, message[:1024])
