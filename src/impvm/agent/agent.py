"""The node agent (``impvm agent``): runs the ImpVMs bound to its node through a
:class:`~impvm.agent.runtime.Runtime`, and reports their lifecycle in ``ImpVM.status``.

This module is the imperative shell around :func:`impvm.agent.lifecycle.decide`: it observes,
asks ``decide`` what to do for one VM, carries the steps out and asks again.

Observing costs no request per VM: two watch caches (:mod:`impvm.kube.watchcache`) hold the VMs
bound to this node (field selector ``spec.nodeName=<node>``) and the ImpVMClasses. Each change of a
VM wakes that VM's worker; a class change wakes the VMs of that class.
What a write returns goes into the cache at once, so the next decision sees it. The VM's JIT
config is obtained once, at start, from a :class:`~impvm.agent.jitsource.JitSource` (the
operator's hand-out: the agent cannot read Secrets).

Binding: the operator binds each VM to a node (``spec.nodeName``, :mod:`impvm.operator.scheduler`)
from the capacity the agents advertise; an agent never picks VMs, and the API server refuses it any
write to a VM not bound to its node (deploy/admission/agent.yaml), so no node can take another's
VMs by winning races. The agent admits a VM bound to it, one at a time, by adding its finalizer
when the VM fits its free capacity (vCPU, MiB), and fails one that does not (``OutOfCapacity``).
Liveness and capacity are advertised in a ``coordination.k8s.io`` Lease ``impvm-agent-<node>``,
renewed every ``lease_renew_seconds``. The same code runs as a DaemonSet pod or as a local process
beside the embedded control plane.

Phases: Scheduled → Starting → Running → Succeeded (exit 0) / Failed (non-zero exit, image pull or
start error, start timeout, ``expireAfter`` deadline: DeadlineExceeded, runtime lost the VM). A
deleted VM is stopped and its files removed before the finalizer is released.

Memory is bounded by the VMs this node works on: a VM's worker and per-VM state go once
``decide`` says the VM needs nothing more (``forget``).

Beside it: :mod:`impvm.agent.steps` carries the steps out (runtime and API),
:mod:`impvm.agent.vmrequest` builds what the runtime is asked for, :mod:`impvm.agent.lease`
builds and applies the Lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError

from impvm.agent import lifecycle as lc
from impvm.agent import metrics
from impvm.agent.capacity import ZERO, Resources, total
from impvm.agent.jitsource import JitSource
from impvm.agent.lease import agent_lease, apply_lease, keep_renewing
from impvm.agent.runtime import Runtime, RuntimeState
from impvm.agent.steps import StepRunner, VMLocal
from impvm.agent.vmrequest import request_for, vm_request, vm_size
from impvm.api.models import (
    AGENT_FINALIZER,
    AGENT_LEASE_NAMESPACE,
    ImpVMClass,
    ImpVMClassSpec,
)
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.api.times import utcnow
from impvm.api.vm import VM
from impvm.kube.events import EventRecorder
from impvm.kube.watchcache import Key, WatchCache

log = logging.getLogger("impvm.agent")


def _parse_vm(raw: dict[str, Any]) -> VM:
    """A VM of the watch: one whose status cannot be read is left out (logged by the cache),
    never taken for a VM nobody started."""
    return VM.from_body(raw, strict=True)


@dataclass
class AgentConfig:
    """Settings of one agent. Sizes in vCPUs and MiB; times in seconds."""

    node_name: str
    capacity: Resources
    workdir: Path
    lease_namespace: str = AGENT_LEASE_NAMESPACE
    lease_duration_seconds: int = 40
    lease_renew_seconds: float = 10.0
    resync_seconds: float = 15.0
    tick_seconds: float = 1.0
    start_timeout_seconds: float = 300.0
    stop_grace_seconds: float = 10.0
    jit_retry_seconds: float = 1.0
    accelerator: str = "none"


@dataclass
class _Worker:
    """The task working one VM and the event that wakes it."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


def _parse_class(raw: dict[str, Any]) -> ImpVMClassSpec:
    return ImpVMClass.model_validate(raw).spec


class Agent:
    """One node's agent. ``run()`` works until cancelled. ``preflight``: whether this host can
    run VMs (an agent whose runtime cannot work admits no VM); ``jit``: where JIT configs
    come from."""

    def __init__(
        self,
        client: AsyncClient,
        runtime: Runtime,
        config: AgentConfig,
        preflight: lc.Preflight | None = None,
        *,
        jit: JitSource,
    ) -> None:
        self.client = client
        self.jit = jit
        self.runtime = runtime
        self.config = config
        self.preflight = preflight or lc.Preflight()
        self.policy = lc.Policy(
            runtime_name=runtime.name,
            tick_seconds=config.tick_seconds,
            start_timeout_seconds=config.start_timeout_seconds,
            stop_grace_seconds=config.stop_grace_seconds,
            jit_retry_seconds=config.jit_retry_seconds,
            console_dir=str(config.workdir / "consoles"),
        )
        self.events = EventRecorder(client, component="impvm-agent", host=config.node_name)
        node = config.node_name
        self.mine: WatchCache[VM] = WatchCache(
            client,
            ImpVMResource,
            _parse_vm,
            fields={"spec.nodeName": node},
            on_change=self._poke,
            name=f"impvms on {node}",
        )
        self.classes: WatchCache[ImpVMClassSpec] = WatchCache(
            client,
            ImpVMClassResource,
            _parse_class,
            namespace=None,
            on_change=self._class_changed,
            name="impvmclasses",
        )
        self._workers: dict[Key, _Worker] = {}
        self._local: dict[Key, VMLocal] = {}
        self._steps = StepRunner(
            client,
            runtime,
            jit,
            self.events,
            self.mine,
            self._local,
            node,
            self.record_capacity,
        )
        self._admit_lock = asyncio.Lock()
        self._ready = False
        self._early: set[Key] = set()

    def tracked(self) -> set[Key]:
        """The VMs this agent holds any state for (a worker or per-VM facts)."""
        return set(self._workers) | set(self._local)

    # ------------------------------------------------------------------ main loops

    async def run(self) -> None:
        """Advertise the node, fill the caches, sweep what an earlier run left, then work VMs
        until cancelled."""
        self.config.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        while True:  # the API server may still be starting
            try:
                await self._renew_lease()
                break
            except ApiError as e:
                log.warning("agent start: %s; retrying", e.status.message)
                await asyncio.sleep(1.0)
        caches = (self.classes, self.mine)
        tasks = [asyncio.create_task(c.run(), name=c.name) for c in caches]
        renewing = keep_renewing(self._renew_lease, self.config.lease_renew_seconds)
        tasks.append(asyncio.create_task(renewing, name="lease"))
        try:
            await asyncio.gather(*(c.synced.wait() for c in caches))
            await self._sweep_stale()
            self._ready = True
            for key in sorted(self._early | set(self.mine.store)):
                self._poke(key)
            self._early.clear()
            tasks.append(asyncio.create_task(self._resync_loop(), name="resync"))
            await asyncio.gather(*tasks)
        finally:
            workers = [w.task for w in self._workers.values() if w.task is not None]
            for t in [*tasks, *workers]:
                t.cancel()
            await asyncio.gather(*tasks, *workers, return_exceptions=True)

    async def _sweep_stale(self) -> None:
        """At start, clean up what a previous run of this agent left: the per-VM state of every
        VM that no longer exists or is no longer bound here (its runtime died with the old agent,
        or the operator released it when this node was lost)."""
        vms_dir = self.config.workdir / "vms"
        if not vms_dir.is_dir():
            return
        live = {vm.vm_id for vm in self.mine.values()}
        for d in sorted(vms_dir.iterdir()):
            if d.name in live:
                continue
            ns, _, rest = d.name.partition(".")  # vm_id: <namespace>.<name>.<uid[:8]>
            stale = request_for(d.name, ns, rest.rsplit(".", 1)[0], ZERO, None, d)
            log.info("removing state of VM %s left by a previous agent run", d.name)
            await self.runtime.stop(stale, 0.0)
            await self.runtime.cleanup(stale)

    async def _renew_lease(self) -> None:
        """Apply the Lease with this node's capacity, runtime and accelerator."""
        c = self.config
        lease = agent_lease(
            c.node_name,
            c.lease_namespace,
            c.lease_duration_seconds,
            capacity=c.capacity,
            used=self.record_capacity(),
            runtime=self.runtime.name,
            accelerator=c.accelerator,
            workdir=c.workdir,
            preflight=self.preflight,
        )
        await apply_lease(self.client, lease)

    async def _resync_loop(self) -> None:
        """Every ``resync_seconds``, wake every cached VM (no API request): a safety net for a
        wake-up that was missed."""
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            for key in sorted(self.mine.store):
                self._poke(key)

    def _poke(self, key: Key) -> None:
        """Wake the worker of VM ``key``, starting one when there is none."""
        if not self._ready:
            self._early.add(key)
            return
        w = self._workers.get(key)
        if w is None:
            w = _Worker()
            self._workers[key] = w
            w.task = asyncio.create_task(self._vm_loop(key, w), name=f"vm {key[0]}/{key[1]}")
        w.wake.set()

    def _class_changed(self, key: Key) -> None:
        """An ImpVMClass was added, changed or removed: wake the VMs that use it."""
        for vm in self.mine.values():
            if vm.class_name == key[1]:
                self._poke(vm.key)

    # ------------------------------------------------------------------ one VM

    async def _vm_loop(self, key: Key, w: _Worker) -> None:
        """Decide and act for one VM until ``decide`` says to forget it; in between, sleep
        until woken or until the action's recheck time."""
        try:
            while True:
                w.wake.clear()
                try:
                    action = await self._step(key)
                except Exception:  # a bug or an unexpected answer: log it, try again later
                    log.exception("vm %s/%s: step failed", *key)
                    action = None
                if action is not None and action.forget:
                    if w.wake.is_set():  # woken meanwhile: look again
                        continue
                    return
                delay = self.config.tick_seconds if action is None else action.recheck_seconds
                if delay == 0:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.wake.wait(), delay)
        finally:
            if self._workers.get(key) is w:
                del self._workers[key]

    async def _step(self, key: Key) -> lc.VMSteps | None:
        """Observe one VM, decide, act. Returns the action, or None when a step failed (then
        the next decision comes after a tick). VMs are admitted one at a time (each admission
        counts the capacity the ones before it took)."""
        vm = self.mine.get(key)
        if vm is not None and not vm.deleting and AGENT_FINALIZER not in vm.finalizers:
            async with self._admit_lock:
                return await self._decide_and_act(key, self.mine.get(key))
        return await self._decide_and_act(key, vm)

    async def _decide_and_act(self, key: Key, vm: VM | None) -> lc.VMSteps | None:
        """Build the observation of one VM (caches, its class, the runtime, what this agent did),
        decide, and carry the action out; forget the VM's state when the action says so."""
        local = self._local.setdefault(key, VMLocal())
        node = self.config.node_name
        spec = self.classes.get(("", vm.class_name)) if vm is not None else None
        size = vm_size(vm, spec) if vm is not None else None
        if size is not None:
            local.size = size
        req = local.request
        if vm is not None and vm.node_name == node:
            workdir = self.config.workdir / "vms" / vm.vm_id
            req = local.request = vm_request(vm, spec, local.size, workdir)
        state = await self.runtime.inspect(req) if req is not None else RuntimeState("missing")
        obs = lc.VMObservation(
            node=node,
            now=utcnow(),
            vm=vm,
            size=size,
            runtime=state,
            capacity=self.config.capacity,
            used=self._used(exclude=key),
            local=local.facts,
            preflight=self.preflight,
            policy=self.policy,
        )
        action = lc.next_steps(obs)
        log.debug("vm %s/%s: %s %s", *key, action.why, [type(s).__name__ for s in action.steps])
        done = await self._steps.execute(key, vm, req, action)
        if done and action.forget:
            self._local.pop(key, None)
        return action if done else None

    def record_capacity(self) -> Resources:
        """Export offered and used capacity (metrics); returns what is used."""
        used = self._used(("", ""))
        c = self.config
        metrics.record_capacity(c.node_name, c.capacity, used, len(self.mine.values()))
        return used

    def _used(self, exclude: Key) -> Resources:
        """vCPU/MiB of the VMs bound here and not yet released, other than ``exclude`` (a VM
        whose class was deleted keeps the size it was given)."""
        sizes: list[Resources] = []
        for vm in self.mine.values():
            if vm.key == exclude or not vm.holds_capacity(self.config.node_name):
                continue
            local = self._local.get(vm.key)
            size = vm_size(vm, self.classes.get(("", vm.class_name)))
            if vm.bound_size is not None:
                size = Resources(*vm.bound_size)  # counted even once its class is gone
            if size is None and local is not None:
                size = local.size
            if size is not None:
                sizes.append(size)
        return total(sizes)
