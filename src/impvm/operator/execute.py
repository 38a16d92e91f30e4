"""Carrying acts out: Kubernetes writes and GitHub calls for one pool, in the order the acts
give, for the pool pass (:class:`PoolExecutor`) and the reaper (:class:`Executor`'s deletions,
Events and status write). No decision is made here; what each act did comes back for the pure
conclusion.

The ImpVM is created before its JIT Secret; the Secret (owned by the VM) is written before its
name is recorded on the VM; the runner id is recorded last (:mod:`impvm.operator.provision`) —
so a crash between any two steps is repaired by the next pass. A deregistration that must come
first keeps the VM unless GitHub accepted it (a busy runner answers 422).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.api.conditions import merge_conditions
from impvm.api.models import API_VERSION, ImpVMRunnerPoolStatus, ImpVMStatus, PoolKey
from impvm.api.patches import wire
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.github import GitHubClient
from impvm.github.errors import (
    BadCredentials,
    Conflict,
    CredentialsError,
    GitHubError,
    InstallationUnavailable,
    NotFound,
    PermissionNotGranted,
    RateLimited,
    RequestRejected,
    TransientError,
)
from impvm.kube.events import EventRecorder
from impvm.operator.credentials import scope_of
from impvm.operator.kubesource import KubeSource
from impvm.operator.runners import RunnerDirectory
from impvm.scaling.poolpass import (
    Deleted,
    DeleteVM,
    Deregistration,
    EventSpec,
    FailureKind,
    GitHubFailure,
    PoolObj,
)

log = logging.getLogger("impvm.operator.execute")

MERGE = PatchType.MERGE
T = TypeVar("T")

#: the error classes of :mod:`impvm.github.errors` and the kind each is
_KINDS: tuple[tuple[type[GitHubError], FailureKind], ...] = (
    (CredentialsError, FailureKind.CREDENTIALS_ERROR),
    (BadCredentials, FailureKind.BAD_CREDENTIALS),
    (PermissionNotGranted, FailureKind.PERMISSION_NOT_GRANTED),
    (InstallationUnavailable, FailureKind.INSTALLATION_UNAVAILABLE),
    (RateLimited, FailureKind.RATE_LIMITED),
    (RequestRejected, FailureKind.REQUEST_REJECTED),
    (NotFound, FailureKind.NOT_FOUND),
    (Conflict, FailureKind.CONFLICT),
    (TransientError, FailureKind.TRANSIENT),
)


def failure_of(err: GitHubError, vm: str | None = None) -> GitHubFailure:
    """The decision's view of a GitHub error (messages are redacted by the client)."""
    kind = next((k for cls, k in _KINDS if isinstance(err, cls)), FailureKind.OTHER)
    return GitHubFailure(
        kind=kind,
        message=str(err),
        retry_after=err.retry_after if isinstance(err, RateLimited) else 0.0,
        rate_kind=err.kind if isinstance(err, RateLimited) else "",
        unavailable_reason=err.reason if isinstance(err, InstallationUnavailable) else "",
        vm=vm,
    )


class Executor:
    """The acts every controller of a pool shares: delete its VMs (deregistering their runners
    as asked), record Events on it, write its status (its own condition types merged into
    what is stored). ``gh``: the pool's client (None: GitHub cannot be asked); ``sources``:
    where own writes go (the operator's caches); ``runners``: the shared runner lists, told
    when a registration of the pool changed; ``clock``: monotonic seconds."""

    def __init__(
        self,
        kube: AsyncClient,
        pool: PoolObj,
        *,
        gh: GitHubClient | None,
        recorder: EventRecorder,
        sources: KubeSource | None = None,
        runners: RunnerDirectory | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.kube, self.pool, self.gh = kube, pool, gh
        self.recorder = recorder
        self.sources = sources or KubeSource(kube)
        self.runners = runners
        self.clock = clock
        self.ns = pool.namespace
        self.scope = scope_of(pool.spec.platform)

    @property
    def key(self) -> PoolKey:
        return self.pool.key

    async def changing(self, call: Awaitable[T]) -> T:
        """Await a GitHub call that may create or delete one of the pool's registrations; then
        (also when it failed: it may have reached GitHub) no runner list begun before it is used
        for the pool (:mod:`impvm.operator.runners`)."""
        try:
            return await call
        finally:
            if self.gh is not None and self.runners is not None and self.clock is not None:
                self.runners.changed(self.gh, self.scope, self.pool.prefix, self.clock())

    async def tolerate(self, write: Awaitable[Any], event: EventSpec | None) -> bool:
        """Await a VM write; a VM gone (404) or changed meanwhile (409) is left to the next
        pass (False). ``event`` is recorded once the write succeeded."""
        try:
            await write
        except ApiError as e:
            if e.status.code not in (404, 409):
                raise
            return False
        if event is not None:
            await self.event(event)
        return True

    async def delete(self, d: DeleteVM) -> Deleted:
        """Delete a VM, deregistering its runner first when asked (see :class:`DeleteVM`)."""
        dereg: Deregistration | None = None
        if d.deregister and self.gh is not None and d.runner_id is not None:
            try:
                answer = await self.changing(self.gh.delete_runner(self.scope, d.runner_id))
                dereg = Deregistration(answer.value)
            except GitHubError as e:
                if d.deregister_first:
                    log.info("keeping %s/%s: deregistration failed: %s", self.ns, d.name, e)
                    return Deleted(name=d.name, deregistration=Deregistration.FAILED)
                log.info("%s/%s: runner not deregistered (%s); deleting anyway", self.ns, d.name, e)
                dereg = Deregistration.FAILED
            if dereg is Deregistration.BUSY and d.keep_if_busy:
                return Deleted(name=d.name, deregistration=dereg)
        elif d.deregister_first and d.runner_id is not None:
            return Deleted(name=d.name)  # GitHub cannot be asked: kept
        try:
            await self.kube.delete(ImpVMResource, d.name, namespace=self.ns)
        except ApiError as e:
            if e.status.code == 404:
                return Deleted(name=d.name, deregistration=dereg, gone=True, missing=True)
            log.warning("%s/%s: deleting the VM failed (HTTP %s)", self.ns, d.name, e.status.code)
            return Deleted(name=d.name, deregistration=dereg, refused=True)
        # its lifetime is observed when the API server removes it (operator/sources.py)
        self.sources.vm_deleted(self.ns, d.name)
        return Deleted(name=d.name, deregistration=dereg, gone=True)

    async def patch_vm_status(self, name: str, status: ImpVMStatus) -> None:
        """Merge a typed status patch into ImpVM ``name``'s status."""
        body = {"status": wire(status)}
        patch = self.kube.patch(
            ImpVMResource.Status, name, body, namespace=self.ns, patch_type=MERGE
        )
        await self.vm_written(patch)

    async def vm_written(self, write: Awaitable[Any]) -> None:
        """Await a VM write and hand the VM it returned to the caches (own writes)."""
        obj = await write
        if obj is not None:
            self.sources.written(ImpVMResource, obj.to_dict())

    async def write_status(
        self, status: ImpVMRunnerPoolStatus | None, ours: Sequence[Mapping[str, Any]]
    ) -> None:
        """Patch the pool's status (``status``: a typed patch, or None for conditions alone).
        Other writers own other condition types: ours are merged into what is stored now,
        guarded by resourceVersion, retried on conflict. A pool gone is left alone."""
        name, src = self.pool.name, self.sources
        fields = wire(status) if status is not None else {}
        for attempt in range(5):
            # the cache first; after a conflict, the API server's current version
            read = src.get if attempt == 0 else src.api_get
            cur = await read(ImpVMRunnerPoolResource, name, self.ns)
            if cur is None:
                return
            stored = (cur.get("status") or {}).get("conditions") or []
            body: dict[str, Any] = {
                "metadata": {"resourceVersion": cur["metadata"]["resourceVersion"]}
            }
            body["status"] = {**fields, "conditions": merge_conditions(stored, ours)}
            try:
                done = await self.kube.patch(
                    ImpVMRunnerPoolResource.Status, name, body, namespace=self.ns, patch_type=MERGE
                )
                src.written(ImpVMRunnerPoolResource, done.to_dict())
                return
            except ApiError as e:
                if e.status.code == 404:
                    return
                if e.status.code != 409:
                    raise

    async def event(self, ev: EventSpec) -> None:
        """An Event on the pool (the recorder also logs it)."""
        await self.recorder.record(
            api_version=API_VERSION,
            kind="ImpVMRunnerPool",
            namespace=self.ns,
            name=self.pool.name,
            uid=self.pool.uid,
            reason=ev.reason,
            message=ev.message,
            warning=ev.warning,
        )
