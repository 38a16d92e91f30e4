"""How the agent carries out the steps :func:`impvm.agent.lifecycle.next_steps` decides for one
VM (:class:`StepRunner`): the runtime's (stop, keep the console, clean up, prepare the image,
start with the JIT config from the agent's :class:`~impvm.agent.jitsource.JitSource`) and the
API's (status and finalizer patches, Events). What a write returns goes into the VM cache at
once, so the next decision sees it; what the runtime learns goes into the VM's
:class:`~impvm.agent.lifecycle.LocalFacts` (:class:`VMLocal`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.agent import lifecycle as lc
from impvm.agent import metrics
from impvm.agent.capacity import Resources
from impvm.agent.jitsource import JitSource, JitSourceError
from impvm.agent.runtime import (
    ImageError,
    Runtime,
    Secret,
    VMRequest,
    VMRuntimeError,
)
from impvm.agent.signing import SignatureError, verification
from impvm.api.models import AGENT_FINALIZER, API_VERSION
from impvm.api.resources import ImpVMResource
from impvm.api.times import utcnow
from impvm.api.vm import VM
from impvm.kube.events import EventRecorder
from impvm.kube.watchcache import Key, WatchCache
from impvm.telemetry.vm_metrics import record_phase

log = logging.getLogger("impvm.agent")


@dataclass
class VMLocal:
    """What the shell keeps about one VM between decisions: the facts ``decide`` sees, the
    last request built for it (to clean up a VM that is gone) and its size when last known (a
    VM whose class was deleted still occupies what it was given)."""

    facts: lc.LocalFacts = field(default_factory=lc.LocalFacts)
    request: VMRequest | None = None
    size: Resources | None = None


class StepRunner:
    """Carries out the steps of one VM's decision. ``mine``: the cache of the VMs bound to
    ``node_name`` (what a write returns goes into it); ``local``: the agent's per-VM state;
    ``on_finalizers``: called after a finalizer was added or removed (the capacity changed)."""

    def __init__(
        self,
        client: AsyncClient,
        runtime: Runtime,
        jit: JitSource,
        events: EventRecorder,
        mine: WatchCache[VM],
        local: dict[Key, VMLocal],
        node_name: str,
        on_finalizers: Callable[[], object],
    ) -> None:
        self.client = client
        self.runtime = runtime
        self.jit = jit
        self.events = events
        self.mine = mine
        self._local = local
        self.node_name = node_name
        self._on_finalizers = on_finalizers

    async def execute(
        self, key: Key, vm: VM | None, req: VMRequest | None, action: lc.VMSteps
    ) -> bool:
        """Carry out the steps in order; False when one failed (the rest is left undone). An
        action runs to its end even when the agent is being stopped (its steps belong
        together: report, then clean up), except one that pulls an image, which may take
        minutes and is safe to abandon."""
        if not action.steps:
            return True
        run = asyncio.ensure_future(self._run_steps(key, vm, req, action.steps))
        if action.has(lc.Prepare):
            return await run
        try:
            return await asyncio.shield(run)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await run
            raise

    async def _run_steps(
        self, key: Key, vm: VM | None, req: VMRequest | None, steps: tuple[lc.Step, ...]
    ) -> bool:
        """The steps in order; False at the first that failed or must stop the rest."""
        for step in steps:
            try:
                if not await self._do(key, vm, req, step):
                    return False
            except ApiError as e:
                if e.status.code != 404:  # a VM gone meanwhile shows in the cache soon
                    log.warning("vm %s/%s: %s: API error %s", *key, type(step).__name__, e)
                return False
        return True

    async def _do(self, key: Key, vm: VM | None, req: VMRequest | None, step: lc.Step) -> bool:
        """One step. Returns False when the rest of the action must not run (a conflict: the
        VM changed meanwhile). Raises ``ApiError``."""
        local = self._local.setdefault(key, VMLocal())
        if isinstance(step, lc.Emit):
            if vm is not None:
                await self._event(vm, step)
            return True
        if isinstance(step, lc.Stop | lc.Cleanup | lc.Prepare | lc.Start | lc.KeepConsole):
            assert req is not None, f"{step} without a request"
            return await self._runtime_step(key, vm, req, local, step)
        assert vm is not None, f"{step} for a VM that is gone"
        if isinstance(step, lc.PatchStatus):
            await self._patch_status(vm, dict(step.fields))
            return True
        if isinstance(step, lc.AddFinalizer):
            ok = await self._patch_meta(vm, [*vm.finalizers, AGENT_FINALIZER])
            if ok:
                self._on_finalizers()
            return ok
        if isinstance(step, lc.Release):
            ok = await self._patch_meta(vm, [f for f in vm.finalizers if f != AGENT_FINALIZER])
            if ok:
                self._on_finalizers()
            return ok
        raise AssertionError(f"unknown step {step!r}")

    async def _runtime_step(
        self, key: Key, vm: VM | None, req: VMRequest, local: VMLocal, step: lc.Step
    ) -> bool:
        """A step the runtime carries out; what it learns goes into the VM's facts."""
        facts = local.facts
        if isinstance(step, lc.Stop):
            await self.runtime.stop(req, step.grace_seconds)
        elif isinstance(step, lc.KeepConsole):
            try:
                await self.runtime.keep_console(req, Path(step.path))
            except OSError as e:  # a full disk must not keep the VM from being cleaned up
                log.warning("vm %s/%s: console not kept: %s", *key, e)
        elif isinstance(step, lc.Cleanup):
            await self.runtime.cleanup(req)
            facts = replace(facts, cleaned=True)
        elif isinstance(step, lc.Prepare):
            try:
                await self.runtime.prepare(req)
                facts = replace(facts, prepared=True, verification=verification(req))
            except SignatureError as e:
                facts = replace(
                    facts, failure=(e.reason, str(e)), verification=verification(req, e)
                )
            except ImageError as e:  # ImagePullFailed, or why the image was refused
                facts = replace(facts, failure=(e.reason, str(e)))
        elif isinstance(step, lc.Start):
            assert vm is not None
            jit = await self._read_jitconfig(vm)
            if jit is None:
                facts = replace(facts, jit_missing_at=utcnow())
            else:
                try:
                    await self.runtime.start(req, jit)
                    facts = replace(facts, jit_missing_at=None, cleaned=False)
                except VMRuntimeError as e:
                    facts = replace(facts, failure=("StartFailed", str(e)))
        local.facts = facts
        return True

    # ------------------------------------------------------------------ API helpers

    def _written(self, raw: dict[str, Any]) -> None:
        """Put what a write returned into the cache (every VM this agent writes is bound
        here)."""
        self.mine.written(raw)

    async def _patch_meta(self, vm: VM, finalizers: list[str]) -> bool:
        """Set the VM's finalizers if it still has the observed resourceVersion. False on a
        conflict or when the VM is gone or refuses the change."""
        patch = {"metadata": {"resourceVersion": vm.resource_version, "finalizers": finalizers}}
        try:
            got = await self.client.patch(
                ImpVMResource, vm.name, patch, namespace=vm.namespace, patch_type=PatchType.MERGE
            )
        except ApiError as e:
            if e.status.code in (404, 409, 422):
                return False
            raise
        self._written(got.to_dict())
        return True

    async def _patch_status(self, vm: VM, status: dict[str, Any]) -> None:
        """Merge ``status`` into the VM's status subresource; the result goes into the cache."""
        got = await self.client.patch(
            ImpVMResource.Status,
            vm.name,
            {"status": status},
            namespace=vm.namespace,
            patch_type=PatchType.MERGE,
        )
        self._written(got.to_dict())
        old = vm.phase
        started = vm.status.started_at
        if status.get("phase") == "Running" and old != "Running" and started is not None:
            booted = (dt.datetime.now(dt.UTC) - started).total_seconds()
            metrics.VM_BOOT.labels(self.node_name).observe(max(0.0, booted))
        record_phase(self.node_name, str(old) if old else None, status.get("phase"))

    async def _read_jitconfig(self, vm: VM) -> Secret | None:
        """The JIT config from the agent's :class:`JitSource`; None while it is not there
        (yet) or cannot be asked for (logged; the start is retried, then times out)."""
        name = vm.spec.runner_config_secret
        if not name:
            return None
        try:
            return await self.jit.jitconfig(vm.namespace, vm.name, name)
        except JitSourceError as e:
            log.warning("JIT config of %s/%s: %s", vm.namespace, vm.name, e)
            return None

    async def _event(self, vm: VM, step: lc.Emit) -> None:
        """Record the step's Event about the VM (aggregated, never raising)."""
        await self.events.record(
            api_version=API_VERSION,
            kind="ImpVM",
            namespace=vm.namespace,
            name=vm.name,
            uid=vm.uid,
            reason=step.reason,
            message=step.message,
            warning=step.warning,
        )
