"""Leader election on a ``coordination.k8s.io`` Lease, the way client-go's ``leaderelection``
package does it (kube-controller-manager, kube-scheduler): one replica holds the Lease and
renews it; the others watch it and take it over when it has not changed for its duration.

- :func:`lease_move` is pure: from the Lease as read, who we are and two clocks, what to do
  (``Acquire``, ``Renew``, ``Standby``) and when to look again.
- Expiry is judged by the *observer's own monotonic clock*: a standby remembers when it last saw
  the Lease change (holder or renew time) and takes over only when it has not changed for
  ``leaseDurationSeconds`` since (client-go's ``observedTime``), so clocks of different machines
  need not agree.
- Writes carry the ``resourceVersion`` read: when two replicas race, the API server lets exactly
  one win (409 for the other).
- Fencing: the leader counts as leading only until ``renew_deadline`` seconds after its last
  successful renewal (monotonic), shorter than the lease duration, so it has stopped before any
  standby can take over. :meth:`LeaderElector.leading` is the check made before every JIT mint;
  :meth:`LeaderElector.hold` returns the moment leadership is lost, and the operator then stops
  all work at once (it exits, like kube-controller-manager).
- The leader writes the URL at which it receives webhooks in the annotation
  :data:`LEADER_URL_ANNOTATION`, so a standby can forward a delivery to it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

log = logging.getLogger("impvm.operator.leader")

LEADER_URL_ANNOTATION = "imp.dev/leader-url"


@dataclass(frozen=True)
class Timing:
    """Seconds: how long a Lease is honoured after its last change; how long a leader keeps
    working after its last successful renewal (< duration); how often every replica looks.
    client-go's defaults (15, 10, 2)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("want 0 < retry period < renew deadline < lease duration")


@dataclass(frozen=True)
class LeaseView:
    """What a replica reads of the Lease: ``holder`` ("" when free), ``renew_time`` (as written,
    compared only for change), ``transitions``, ``resource_version``."""

    holder: str
    renew_time: str
    transitions: int
    resource_version: str


@dataclass(frozen=True)
class Observation:
    """The last change of the Lease a replica saw (the record) and when it saw it (its own
    monotonic clock)."""

    record: tuple[str, str]
    seen_at: float


@dataclass(frozen=True)
class Acquire:
    """Write ourselves as holder (``create``: the Lease does not exist yet)."""

    create: bool
    transitions: int


@dataclass(frozen=True)
class Renew:
    """We hold it: write a new renew time."""


@dataclass(frozen=True)
class Standby:
    """Someone else holds a Lease that has not expired: wait."""

    holder: str


#: what a replica does with the Lease (:func:`lease_move`)
LeaseMove = Acquire | Renew | Standby


def observe(lease: LeaseView | None, last: Observation | None, now: float) -> Observation:
    """The new observation: the record changed (or is first seen) → seen now; else unchanged.
    Pure."""
    record = (lease.holder, lease.renew_time) if lease is not None else ("", "")
    if last is None or last.record != record:
        return Observation(record, now)
    return last


def lease_move(
    lease: LeaseView | None, me: str, seen: Observation, now: float, timing: Timing
) -> LeaseMove:
    """What replica ``me`` does, given the Lease (None: missing), when it last saw it change
    (``seen``) and the monotonic ``now``. Pure."""
    if lease is None:
        return Acquire(create=True, transitions=0)
    if lease.holder == me:
        return Renew()
    if lease.holder == "" or now - seen.seen_at >= timing.lease_duration:
        return Acquire(create=False, transitions=lease.transitions + 1)
    return Standby(lease.holder)


def _view(lease: Lease) -> LeaseView:
    spec = lease.spec or LeaseSpec()
    rt = spec.renewTime
    return LeaseView(
        holder=spec.holderIdentity or "",
        renew_time=rt.isoformat() if isinstance(rt, dt.datetime) else str(rt or ""),
        transitions=spec.leaseTransitions or 0,
        resource_version=(lease.metadata.resourceVersion if lease.metadata else None) or "",
    )


class LeaderElector:
    """Elects one leader among the replicas sharing Lease ``namespace/name``. ``identity``:
    unique per replica (e.g. pod name plus a random part); ``url``: where this replica receives
    webhooks (written on the Lease while it leads). ``monotonic``: the clock (tests)."""

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        name: str,
        identity: str,
        url: str = "",
        timing: Timing | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.url = url
        self.timing = timing or Timing()
        self.monotonic = monotonic
        self._seen: Observation | None = None
        self._renewed_at: float | None = None  # monotonic time of our last successful write
        self._leader_url = ""
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ queries

    def leading(self) -> bool:
        """Whether this replica may act as leader now: it holds the Lease and renewed it less
        than ``renew_deadline`` seconds ago (the fencing check; synchronous, no I/O)."""
        at = self._renewed_at
        return at is not None and self.monotonic() - at < self.timing.renew_deadline

    @property
    def leader_url(self) -> str:
        """The URL the current leader advertised ("" when unknown or ourselves)."""
        return "" if self.leading() else self._leader_url

    async def settle(self, seconds: float) -> None:
        """Return once this replica leads or knows the leader's URL, or after ``seconds``
        (a replica serves HTTP before its first read of the Lease; a delivery arriving in
        between waits for that read instead of being refused)."""
        deadline = self.monotonic() + seconds
        while not self.leading() and not self._leader_url:
            left = deadline - self.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                return

    # ------------------------------------------------------------------ loop

    async def step(self) -> LeaseMove:
        """Read the Lease once, decide and write; returns what was decided. Raises on API
        errors other than a lost race (409) or a missing Lease."""
        lease: Lease | None
        try:
            lease = await self.client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as e:
            if e.status.code != 404:
                raise
            lease = None
        view = _view(lease) if lease is not None else None
        now = self.monotonic()
        self._seen = observe(view, self._seen, now)
        if lease is not None:
            ann = (lease.metadata.annotations if lease.metadata else None) or {}
            self._leader_url = ann.get(LEADER_URL_ANNOTATION, "")
        action = lease_move(view, self.identity, self._seen, now, self.timing)
        if isinstance(action, Standby):
            self._looked()
            return action
        body = self._body(view, action)
        try:
            if isinstance(action, Acquire) and action.create:
                await self.client.create(body)
            else:
                await self.client.replace(body)
        except ApiError as e:
            if e.status.code in (404, 409):  # someone else wrote first: look again
                return Standby(view.holder if view else "")
            raise
        was_leading = self.leading()
        self._renewed_at = now
        self._looked()
        if isinstance(action, Acquire) or not was_leading:
            log.info("leading (Lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
        return action

    def _looked(self) -> None:
        """Wake :meth:`settle` waiters (each waits on the event of its time)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _body(self, view: LeaseView | None, action: Acquire | Renew) -> Lease:
        now = dt.datetime.now(dt.UTC)
        transitions = (
            action.transitions if isinstance(action, Acquire) else view.transitions if view else 0
        )
        spec = LeaseSpec(
            holderIdentity=self.identity,
            leaseDurationSeconds=max(1, round(self.timing.lease_duration)),
            renewTime=now,
            leaseTransitions=transitions,
        )
        if isinstance(action, Acquire):
            spec.acquireTime = now
        meta = ObjectMeta(
            name=self.name,
            namespace=self.namespace,
            labels={"app.kubernetes.io/name": "impvm-operator"},
            annotations={LEADER_URL_ANNOTATION: self.url} if self.url else None,
        )
        if view is not None:
            meta.resourceVersion = view.resource_version
        return Lease(metadata=meta, spec=spec)

    async def acquire(self) -> None:
        """Return once this replica leads (looks every ``retry_period``; API errors are logged
        and retried)."""
        while True:
            await self._try_step()
            if self.leading():
                return
            await asyncio.sleep(self.timing.retry_period)

    async def hold(self) -> None:
        """Renew every ``retry_period`` while leading; return as soon as leadership is lost
        (a failed renewal past ``renew_deadline``, or another holder)."""
        while self.leading():
            assert self._renewed_at is not None
            left = self.timing.renew_deadline - (self.monotonic() - self._renewed_at)
            try:  # a renewal that hangs must not outlive the deadline
                await asyncio.wait_for(self._try_step(), timeout=max(0.01, left))
            except TimeoutError:
                log.warning("Lease %s/%s: renewal timed out", self.namespace, self.name)
            if not self.leading():
                break
            assert self._renewed_at is not None
            left = self.timing.renew_deadline - (self.monotonic() - self._renewed_at)
            await asyncio.sleep(max(0.0, min(self.timing.retry_period, left)))
        log.warning("lost the lead (Lease %s/%s)", self.namespace, self.name)

    async def release(self) -> None:
        """Give the Lease up on a clean stop (client-go's ``ReleaseOnCancel``): write an empty
        holder, so a standby or the restarted replica takes over at once instead of after the
        lease duration. Only while leading; errors are logged, never raised."""
        if not self.leading():
            return
        self._renewed_at = None  # fenced first: nothing may act as leader from here on
        try:
            lease = await self.client.get(Lease, self.name, namespace=self.namespace)
            if lease.spec is None or lease.spec.holderIdentity != self.identity:
                return
            lease.spec.holderIdentity = ""
            await self.client.replace(lease)
            log.info("released the Lease %s/%s", self.namespace, self.name)
        except Exception as e:  # the Lease then simply expires
            log.warning("Lease %s/%s not released: %s", self.namespace, self.name, _why(e))

    async def _try_step(self) -> None:
        try:
            action = await self.step()
        except Exception as e:  # API and transport errors: looked at again next period
            log.warning("Lease %s/%s: %s", self.namespace, self.name, _why(e))
            return
        if isinstance(action, Standby) and action.holder != self.identity:
            self._renewed_at = None  # another holder: we are not leading any more


def _why(e: BaseException) -> str:
    if isinstance(e, ApiError):
        return f"{e.status.code} {e.status.reason}"
    return type(e).__name__
