"""The node agent (``impvm agent``): claims ImpVMs for its node, runs them through a
:class:`~impvm.agent.runtime.Runtime`, and reports their lifecycle in ``ImpVM.status``.

Binding: an agent claims an unbound VM by setting ``spec.nodeName`` (and its finalizer) in one
update that carries the VM's ``resourceVersion``, so when several agents race the API server lets
exactly one win (409 for the others); the CRD forbids changing ``nodeName`` afterwards. An agent
claims only what fits its advertised capacity (vCPU, MiB). Liveness and capacity are advertised in
a ``coordination.k8s.io`` Lease ``impvm-agent-<node>``, renewed every ``lease_renew_seconds``. The
same code runs as a DaemonSet pod or as a local process beside the embedded control plane.

Phases (issue: pool controller and node agent): Scheduled → Starting → Running → Succeeded (exit 0)
/ Failed (non-zero exit, start error, start timeout, ``expireAfter`` deadline: DeadlineExceeded).
A deleted VM is stopped and its scratch removed before the finalizer is released.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Secret as K8sSecret
from lightkube.types import PatchType

from impvm.agent.capacity import Resources, fits, total
from impvm.agent.runtime import ImageError, Runtime, RuntimeError_, Secret, VMRequest, VMState
from impvm.agent.signing import SignatureError, image_verified_status
from impvm.api.durations import resolve_expire_after
from impvm.api.models import (
    AGENT_FINALIZER,
    AGENT_LEASE_NAMESPACE,
    AGENT_LEASE_PREFIX,
    JIT_SECRET_KEY,
    TERMINAL_PHASES,
    ImpVM,
    ImpVMClass,
    ImpVMClassSpec,
)
from impvm.api.resources import ImpVMClassResource, ImpVMResource
from impvm.api.times import k8s_time, utcnow
from impvm.events import EventRecorder

log = logging.getLogger("impvm.agent")

FINALIZER = AGENT_FINALIZER
LEASE_PREFIX = AGENT_LEASE_PREFIX


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
    accelerator: str = "none"


@dataclass
class _Worker:
    task: asyncio.Task[None]
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Agent:
    """One node's agent. ``run()`` works until cancelled."""

    def __init__(self, client: AsyncClient, runtime: Runtime, config: AgentConfig) -> None:
        self.client = client
        self.runtime = runtime
        self.config = config
        self.events = EventRecorder(client, component="impvm-agent", host=config.node_name)
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._claimed: dict[tuple[str, str], Resources] = {}
        self._claim_lock = asyncio.Lock()
        self._classes: dict[str, ImpVMClassSpec] = {}
        self._cleaned: set[str] = set()

    # ------------------------------------------------------------------ main loops

    async def run(self) -> None:
        """Advertise the node, then watch and work VMs until cancelled."""
        self.config.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        while True:  # the API server may still be starting (e.g. a just-installed CRD)
            try:
                await self._renew_lease()
                await self._sweep_stale()
                await self._resync()
                break
            except ApiError as e:
                log.warning("agent start: %s; retrying", e.status.message)
                await asyncio.sleep(1.0)
        tasks = [
            asyncio.create_task(self._lease_loop(), name="lease"),
            asyncio.create_task(self._watch_loop(), name="watch"),
            asyncio.create_task(self._resync_loop(), name="resync"),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for w in list(self._workers.values()):
                w.task.cancel()
            await asyncio.gather(
                *tasks, *(w.task for w in self._workers.values()), return_exceptions=True
            )

    async def _sweep_stale(self) -> None:
        """At start, clean up what a previous run of this agent left: the per-VM state of every
        VM that no longer exists or is no longer bound here (its runtime died with the old agent,
        or the operator released it when this node was lost)."""
        vms_dir = self.config.workdir / "vms"
        if not vms_dir.is_dir():
            return
        live: dict[str, tuple[ImpVM, dict[str, Any]]] = {}
        async for raw in self.client.list(ImpVMResource, namespace="*"):
            obj = raw.to_dict()
            vm = ImpVM.model_validate(obj)
            if vm.spec.node_name == self.config.node_name:
                req = self._request(vm, obj["metadata"])
                live[req.vm_id] = (vm, obj["metadata"])
        for d in sorted(vms_dir.iterdir()):
            if d.name in live:
                continue
            ns, _, rest = d.name.partition(".")  # vm_id: <namespace>.<name>.<uid[:8]>
            name = rest.rsplit(".", 1)[0]
            stale = VMRequest(
                vm_id=d.name,
                name=name,
                namespace=ns,
                image="",
                runner_layer=None,
                allow_unpinned_images=False,
                vcpu=1,
                memory_mib=0,
                disk_gib=0,
                workdir=d,
            )
            log.info("removing state of VM %s left by a previous agent run", d.name)
            await self.runtime.stop(stale, 0.0)
            await self.runtime.cleanup(stale)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_renew_seconds)
            try:
                await self._renew_lease()
            except Exception as e:  # keep renewing; the next try may work
                log.warning("lease renewal failed: %s", e)

    async def _renew_lease(self) -> None:
        c = self.config
        name = LEASE_PREFIX + c.node_name
        annotations = {
            "imp.dev/vcpu": str(c.capacity.vcpu),
            "imp.dev/memory-mib": str(c.capacity.memory_mib),
            "imp.dev/runtime": self.runtime.name,
            "imp.dev/accelerator": c.accelerator,
        }
        now = dt.datetime.now(dt.UTC)
        body = Lease(
            metadata=ObjectMeta(
                name=name,
                namespace=c.lease_namespace,
                annotations=annotations,
                labels={"app.kubernetes.io/name": "impvm-agent"},
            ),
            spec=LeaseSpec(
                holderIdentity=c.node_name,
                leaseDurationSeconds=c.lease_duration_seconds,
                renewTime=now,
            ),
        )
        await self.client.apply(body, field_manager="impvm-agent", force=True)

    async def _watch_loop(self) -> None:
        while True:
            try:
                async for _kind, obj in self.client.watch(ImpVMResource, namespace="*"):
                    self._poke(obj["metadata"]["namespace"], obj["metadata"]["name"])
            except Exception as e:  # watch ended or failed: back off and watch again
                log.info("watch ended (%s); restarting", e)
                await asyncio.sleep(1.0)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            try:
                await self._resync()
            except Exception as e:
                log.warning("resync failed: %s", e)

    async def _resync(self) -> None:
        async for obj in self.client.list(ImpVMResource, namespace="*"):
            self._poke(obj["metadata"]["namespace"], obj["metadata"]["name"])

    def _poke(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        w = self._workers.get(key)
        if w is None or w.task.done():
            w = _Worker(task=asyncio.create_task(self._vm_loop(key), name=f"vm {namespace}/{name}"))
            self._workers[key] = w
        w.wake.set()

    # ------------------------------------------------------------------ one VM

    async def _vm_loop(self, key: tuple[str, str]) -> None:
        """Work one VM until it no longer needs this agent (not ours, finished, or gone)."""
        await asyncio.sleep(0)
        w = self._workers[key]
        try:
            while True:
                w.wake.clear()
                try:
                    again = await self._step(key)
                except ApiError as e:
                    if e.status.code == 404:
                        again = False
                    else:
                        log.warning("vm %s/%s: API error %s", *key, e.status.code)
                        again = True
                if not again:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.wake.wait(), self.config.tick_seconds)
        finally:
            self._claimed.pop(key, None)

    async def _step(self, key: tuple[str, str]) -> bool:
        """One pass over one VM. Returns whether the VM still needs attention."""
        ns, name = key
        try:
            raw = await self.client.get(ImpVMResource, name, namespace=ns)
        except ApiError as e:
            if e.status.code == 404:
                return False
            raise
        obj: dict[str, Any] = raw.to_dict()
        vm = ImpVM.model_validate(obj)
        meta = obj["metadata"]
        node = vm.spec.node_name
        phase = vm.status.phase if vm.status else None
        deleting = bool(meta.get("deletionTimestamp"))
        finalizers: list[str] = list(meta.get("finalizers") or [])

        if not node:
            if deleting or phase in TERMINAL_PHASES:
                return False
            return await self._try_claim(key, vm, meta)
        if node != self.config.node_name:
            return False

        req = self._request(vm, meta)
        if deleting:
            if phase not in TERMINAL_PHASES and phase != "Terminating":
                await self._patch_status(key, {"phase": "Terminating"})
            await self.runtime.stop(req, self.config.stop_grace_seconds)
            await self._cleanup(req)
            await self._release(key, meta, finalizers)
            return False
        if phase in TERMINAL_PHASES:
            await self._cleanup(req)
            await self._release(key, meta, finalizers)
            return False

        if key not in self._claimed:
            self._claimed[key] = await self._class_resources(vm.spec.class_ref.name) or Resources(
                0, 0
            )
        if phase in (None, "Pending", "Scheduled"):
            return await self._start(key, vm, req)
        return await self._observe(key, vm, req)

    async def _try_claim(self, key: tuple[str, str], vm: ImpVM, meta: dict[str, Any]) -> bool:
        need = await self._class_resources(vm.spec.class_ref.name)
        if need is None:
            return True  # class missing: wait for it (the operator reports it)
        async with self._claim_lock:
            used = total(list(self._claimed.values()))
            if not fits(self.config.capacity, used, need):
                return True  # no room now; look again at the next tick
            # jitter so several agents do not collide on every VM
            await asyncio.sleep(random.uniform(0, 0.05))
            patch = {
                "metadata": {
                    "resourceVersion": meta["resourceVersion"],
                    "finalizers": [*(meta.get("finalizers") or []), FINALIZER],
                },
                "spec": {"nodeName": self.config.node_name},
            }
            try:
                await self.client.patch(
                    ImpVMResource, key[1], patch, namespace=key[0], patch_type=PatchType.MERGE
                )
            except ApiError as e:
                if e.status.code in (409, 422, 404):
                    return e.status.code == 409  # lost the race or VM gone
                raise
            self._claimed[key] = need
        await self._patch_status(key, {"phase": "Scheduled", "nodeName": self.config.node_name})
        await self._event(key, meta, "Scheduled", f"bound to node {self.config.node_name}")
        return True

    async def _start(self, key: tuple[str, str], vm: ImpVM, req: VMRequest) -> bool:
        status = vm.status
        if status is None or status.phase != "Scheduled":
            await self._patch_status(key, {"phase": "Scheduled", "nodeName": self.config.node_name})
        try:
            await self.runtime.prepare(req)
        except SignatureError as e:
            await self._fail(key, vm, req, e.reason, str(e), image_verified_status(req, e))
            return True
        except ImageError as e:
            await self._fail(key, vm, req, "ImagePullFailed", str(e))
            return True
        secret_name = vm.spec.runner_config_secret
        if not secret_name:
            return True  # the operator has not attached the JIT config yet
        jit = await self._read_jitconfig(key[0], secret_name)
        if jit is None:
            return True
        started = utcnow()
        try:
            await self.runtime.start(req, jit)
        except RuntimeError_ as e:
            await self._fail(key, vm, req, "StartFailed", str(e))
            return True
        await self._patch_status(
            key,
            {"phase": "Starting", "startedAt": k8s_time(started), **image_verified_status(req)},
        )
        await self._event(key, None, "Started", f"runtime {self.runtime.name} started the VM")
        return True

    async def _observe(self, key: tuple[str, str], vm: ImpVM, req: VMRequest) -> bool:
        assert vm.status is not None
        phase = vm.status.phase
        started = vm.status.started_at
        state = await self.runtime.inspect(req)
        now = utcnow()
        expire = resolve_expire_after(vm.spec.expire_after)
        if expire and started and (now - started).total_seconds() >= expire:
            await self.runtime.stop(req, self.config.stop_grace_seconds)
            await self._fail(
                key, vm, req, "DeadlineExceeded", f"expireAfter {vm.spec.expire_after} passed"
            )
            return True
        if state.status == "exited":
            await self._finish(key, vm, req, state)
            return True
        if state.status == "missing":
            await self._fail(
                key, vm, req, "Lost", "the runtime no longer knows this VM (agent restarted?)"
            )
            return True
        if state.status == "running" and phase != "Running":
            await self._patch_status(key, {"phase": "Running"})
        elif (
            state.status == "starting"
            and started
            and (now - started).total_seconds() >= self.config.start_timeout_seconds
        ):
            await self.runtime.stop(req, self.config.stop_grace_seconds)
            await self._fail(key, vm, req, "StartTimeout", state.log_tail[-2000:])
        return True

    async def _finish(self, key: tuple[str, str], vm: ImpVM, req: VMRequest, st: VMState) -> None:
        code = st.exit_code if st.exit_code is not None else -1
        finished = st.finished_at or utcnow()
        if code == 0:
            await self._patch_status(
                key,
                {
                    "phase": "Succeeded",
                    "exitCode": 0,
                    "exitReason": "Completed",
                    "finishedAt": k8s_time(finished),
                },
            )
            await self._event(key, None, "Succeeded", "runner exited 0")
        else:
            await self._patch_status(
                key,
                {
                    "phase": "Failed",
                    "exitCode": code,
                    "exitReason": "Error",
                    "finishedAt": k8s_time(finished),
                    "message": st.log_tail[-2000:],
                },
            )
            await self._event(key, None, "Failed", f"runner exited {code}", warning=True)
        await self._cleanup(req)

    async def _fail(
        self,
        key: tuple[str, str],
        vm: ImpVM,
        req: VMRequest,
        reason: str,
        message: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        await self._patch_status(
            key,
            {
                "phase": "Failed",
                "exitReason": reason,
                "finishedAt": k8s_time(utcnow()),
                "message": message[-2000:],
                **(extra or {}),
            },
        )
        await self._event(key, None, reason, message[-500:], warning=True)
        await self.runtime.stop(req, self.config.stop_grace_seconds)
        await self._cleanup(req)

    async def _cleanup(self, req: VMRequest) -> None:
        if req.vm_id in self._cleaned:
            return
        await self.runtime.cleanup(req)
        self._cleaned.add(req.vm_id)

    async def _release(self, key: tuple[str, str], meta: dict[str, Any], fins: list[str]) -> None:
        self._claimed.pop(key, None)
        if FINALIZER not in fins:
            return
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "finalizers": [f for f in fins if f != FINALIZER],
            }
        }
        try:
            await self.client.patch(
                ImpVMResource, key[1], patch, namespace=key[0], patch_type=PatchType.MERGE
            )
        except ApiError as e:
            if e.status.code not in (404, 409):
                raise
            if e.status.code == 409:  # changed meanwhile: the next pass retries
                self._poke(*key)

    # ------------------------------------------------------------------ helpers

    def _request(self, vm: ImpVM, meta: dict[str, Any]) -> VMRequest:
        ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        vm_id = f"{ns}.{name}.{uid[:8]}"
        cls = self._classes.get(vm.spec.class_ref.name)
        return VMRequest(
            vm_id=vm_id,
            name=name,
            namespace=ns,
            image=vm.spec.image,
            runner_layer=vm.spec.runner_layer,
            allow_unpinned_images=bool(vm.spec.allow_unpinned_images),
            vcpu=cls.vcpu if cls else 1,
            memory_mib=cls.memory_mib if cls else 512,
            disk_gib=cls.disk_gib if cls else 1,
            workdir=self.config.workdir / "vms" / vm_id,
            verify_public_key=vm.spec.verify.public_key if vm.spec.verify else None,
        )

    async def _class_resources(self, name: str) -> Resources | None:
        """vCPU/MiB of an ImpVMClass (cached; a deleted class keeps its last known size)."""
        try:
            raw = await self.client.get(ImpVMClassResource, name)
            self._classes[name] = ImpVMClass.model_validate(raw.to_dict()).spec
        except ApiError as e:
            if e.status.code != 404:
                raise
        spec = self._classes.get(name)
        return Resources(spec.vcpu, spec.memory_mib) if spec else None

    async def _read_jitconfig(self, namespace: str, name: str) -> Secret | None:
        try:
            sec = await self.client.get(K8sSecret, name, namespace=namespace)
        except ApiError as e:
            if e.status.code in (403, 404):
                return None
            raise
        data = (sec.data or {}).get(JIT_SECRET_KEY)
        if not data:
            return None
        return Secret(base64.b64decode(data).decode())

    async def _patch_status(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        await self.client.patch(
            ImpVMResource.Status,
            key[1],
            {"status": status},
            namespace=key[0],
            patch_type=PatchType.MERGE,
        )

    async def _event(
        self,
        key: tuple[str, str],
        meta: dict[str, Any] | None,
        reason: str,
        message: str,
        warning: bool = False,
    ) -> None:
        if meta is None:
            try:
                meta = (await self.client.get(ImpVMResource, key[1], namespace=key[0]))["metadata"]
            except ApiError:
                return
        assert meta is not None
        await self.events.record(
            api_version="imp.dev/v1alpha1",
            kind="ImpVM",
            namespace=key[0],
            name=key[1],
            uid=meta.get("uid", ""),
            reason=reason,
            message=message,
            warning=warning,
        )
