"""The embedded stack, shared by ``impvm dev up`` and the end-to-end tests: ``impvm up`` (the
single-machine service, :mod:`impvm.up.service`) with a generated configuration, plus what that
configuration points at in development.

What development adds, all real: the GitHub stand-in (in this process) seeded with an App, its
installation on ``my-org``, a repository and the runner group ``omni-runner``; a loopback OCI
registry with a busybox base image and a runner layer whose ``run.sh`` is the stand-in runner,
both pinned by digest. The generated ``impvm.yaml`` (in the work directory) names the stand-in as
GitHub, the App's key file, the registry as insecure, and the minimal example with the two
image placeholders replaced by the pushed digests as its class, template and pool; the service
then runs the control plane, the operator and one agent from it exactly as ``impvm up`` does.

Networks (as root, the default then): the stand-in listens in a namespace of its own, the stand-in
"internet" (:class:`impvm.devstack.netns.DevNetwork`); the agent gives each VM its own network
(``guestNetwork: isolated``) and guests reach the stand-in through the node's NAT, as they
would reach GitHub, and nothing else; the operator reaches it over the host's route to that
namespace. Not as root: the stand-in on loopback and ``guestNetwork: unisolated`` (no isolation,
and the service says so at start).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig

from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.devconfig import StackConfig, dev_config
from impvm.devstack.netns import DevNetwork
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.seed import (
    NAMESPACE,
    POOL,
    REPO,
    make_private_key,
    pool_manifest,
    random_webhook_secret,
    seed_github,
)
from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import TestImages, build_test_images
from impvm.kube.controlplane import ControlPlane, free_port, write_private
from impvm.up.config import WEBHOOK_SECRET
from impvm.up.loader import load_config
from impvm.up.service import Service


@dataclass
class Stack:
    """The running stack. Use ``await Stack(cfg).start()`` and ``await stack.stop()``; or
    :meth:`start_fixtures`, then run :attr:`service` (``impvm dev up`` does, through
    :func:`impvm.up.main.serve`)."""

    config: StackConfig
    standin: StandIn | None = None
    registry: LocalRegistry | None = None
    images: TestImages | None = None
    service: Service | None = None
    private_key_pem: str = field(default="", repr=False)
    webhook_secret: str = field(default="", repr=False)
    operator_http_port: int = 0
    agent_metrics_port: int = 0
    devnet: DevNetwork | None = None
    _kube: AsyncClient | None = None

    @property
    def control_plane(self) -> ControlPlane | None:
        return self.service.control_plane if self.service else None

    @property
    def kubeconfig(self) -> Path:
        assert self.service is not None
        return self.service.kubeconfig

    @property
    def kubeconfigs(self) -> dict[str, Path]:
        """kubeconfig per component (operator, agent), acting as its ServiceAccount."""
        return self.service.kubeconfigs if self.service else {}

    @property
    def procs(self) -> dict[str, Any]:
        return self.service.procs if self.service else {}

    @property
    def config_file(self) -> Path:
        """The generated ``impvm.yaml``."""
        return self.config.workdir / "impvm.yaml"

    @property
    def kube(self) -> AsyncClient | None:
        """An admin client of the control plane (once the service started)."""
        if self._kube is None and self.control_plane is not None and self.control_plane.procs:
            self._kube = AsyncClient(
                config=KubeConfig.from_file(str(self.kubeconfig)), field_manager="impvm-devstack"
            )
        return self._kube

    async def start(self) -> Stack:
        """Start every piece; raises on the first failure (call :meth:`stop` to clean up)."""
        await self.start_fixtures()
        assert self.service is not None
        await self.service.start(start_agent=self.config.start_agent)
        await self.after_start()
        return self

    async def start_fixtures(self) -> Service:
        """Start the stand-in and the registry, build the test images, write the App key and
        ``impvm.yaml``, and make (not start) the service from that file."""
        wd = self.config.workdir
        wd.mkdir(parents=True, exist_ok=True, mode=0o700)
        isolated = self.config.isolated_network
        if isolated is None:
            isolated = os.geteuid() == 0
        if isolated:
            # guests reach the stand-in as they would reach GitHub: through the node's NAT,
            # in a namespace of its own
            self.devnet = await asyncio.to_thread(DevNetwork.create)
            atexit.register(self.devnet.delete)
            sock = self.devnet.internet.socket(self.devnet.server_address, 0)
            self.standin = StandIn(sock=sock)
        else:
            self.standin = StandIn()
        await self.standin.start()
        if self.devnet is None and self.config.runtime == "qemu":
            # QEMU user-mode networking: the guest reaches the host's loopback as 10.0.2.2
            self.standin.state.runner_base_url = f"http://10.0.2.2:{self.standin.port}"
        self._seed_github()
        self.registry = LocalRegistry(storage_dir=wd / "registry")
        await self.registry.start()
        self.images = await build_test_images(wd / "images", self.registry.address)

        secrets_dir = wd / "secrets"
        secrets_dir.mkdir(exist_ok=True, mode=0o700)
        key_file = secrets_dir / "app.pem"
        write_private(key_file, self.private_key_pem.encode())
        hook_file = None
        if self.config.scaling_mode in ("webhook", "hybrid"):
            self.webhook_secret = random_webhook_secret()
            hook_file = secrets_dir / "webhook-secret"
            write_private(hook_file, self.webhook_secret.encode())
        self.operator_http_port = free_port()
        self.agent_metrics_port = free_port()
        cfg = dev_config(
            workdir=wd,
            standin_url=self.standin.url,
            key_file=key_file,
            registry=self.registry.address,
            images=self.images if self.config.apply_example else None,
            operator_port=self.operator_http_port,
            agent_metrics_port=self.agent_metrics_port,
            runtime=self.config.runtime,
            agent_vcpu=self.config.agent_vcpu,
            agent_memory_mib=self.config.agent_memory_mib,
            scaling_mode=self.config.scaling_mode,
            polling_interval_seconds=self.config.polling_interval_seconds,
            webhook_secret_file=hook_file,
            devnet=self.devnet,
            cosign=self.config.cosign,
        )
        self.config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.service = Service(load_config(self.config_file), source=str(self.config_file))
        return self.service

    async def after_start(self) -> None:
        """What follows the service's start: the App's webhook, pointed at the operator."""
        assert self.standin is not None
        if self.webhook_secret:
            self.standin.add_webhook(
                f"http://127.0.0.1:{self.operator_http_port}/webhooks/github",
                self.webhook_secret,
                self.config.webhook_drop_rate,
            )

    def _seed_github(self) -> None:
        assert self.standin is not None
        self.private_key_pem = make_private_key()
        seed_github(self.standin, self.private_key_pem)

    async def add_pool(
        self,
        name: str,
        labels: list[str],
        *,
        min_idle: int = 0,
        max_concurrent: int = 5,
        scale_up_step: int = 5,
        cooldown_seconds: int = 5,
        mode: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Apply another pool from the example's template (same org, group and credentials),
        the way a user adds one with kubectl."""
        assert self.kube is not None
        mode = mode or self.config.scaling_mode
        scaling: dict[str, Any] = {
            "mode": mode,
            "minIdle": min_idle,
            "maxConcurrent": max_concurrent,
            "scaleUpStep": scale_up_step,
            "cooldownSeconds": cooldown_seconds,
        }
        if mode in ("polling", "hybrid"):
            scaling["polling"] = {
                "enabled": True,
                "intervalSeconds": self.config.polling_interval_seconds or 30,
            }
        if mode in ("webhook", "hybrid"):
            scaling["webhook"] = {"secretRef": {"name": WEBHOOK_SECRET}}
        doc = pool_manifest(name, NAMESPACE, scaling, labels=labels, **(extra or {}))
        await self.kube.create(ImpVMRunnerPoolResource.from_dict(doc))

    # ------------------------------------------------------------------ processes

    def start_agent(self, node: str = "node-1") -> None:
        """Start (or restart) the agent process for ``node``."""
        assert self.service is not None
        self.service.start_agent(node)

    def start_operator(self, replica: int = 0, port: int | None = None) -> str:
        """Start (or restart) an operator replica (``operator``, or ``operator-<replica>`` on
        ``port``); returns its process name."""
        assert self.service is not None
        return self.service.start_operator(replica, port)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one process (``operator`` or ``agent-<node>``) and wait for it."""
        if self.service is not None:
            self.service.kill(name, sig)

    def logs(self) -> str:
        """Every log the stack wrote (for secret-leak checks and failure reports)."""
        out = []
        for f in sorted(self.config.workdir.glob("*.log")):
            out.append(f.read_text(errors="replace"))
        if self.control_plane:
            for f in sorted(self.control_plane.workdir.glob("*.log")):
                out.append(f.read_text(errors="replace"))
        return "\n".join(out)

    # ------------------------------------------------------------------ jobs and views

    def queue_jobs(self, n: int, labels: list[str] | None = None, sleep: float = 1.0) -> list[int]:
        """Queue ``n`` jobs in the stand-in needing ``labels`` (default: self-hosted, imp)."""
        assert self.standin is not None
        return [
            self.standin.queue_job(
                REPO, labels or ["self-hosted", "imp"], name=f"job-{i}", sleep_seconds=sleep
            ).id
            for i in range(n)
        ]

    async def vms(self) -> list[dict[str, Any]]:
        """Every ImpVM in the default namespace, as dicts."""
        assert self.kube is not None
        return [o.to_dict() async for o in self.kube.list(ImpVMResource, namespace=NAMESPACE)]

    async def pool_status(self, name: str = POOL) -> dict[str, Any]:
        """A pool's status (default: the example pool)."""
        assert self.kube is not None
        obj = await self.kube.get(ImpVMRunnerPoolResource, name, namespace=NAMESPACE)
        status: dict[str, Any] = obj.to_dict().get("status") or {}
        return status

    def jobs(self) -> list[Any]:
        """The stand-in's job records."""
        assert self.standin is not None
        return list(self.standin.state.jobs.values())

    def runners(self) -> list[Any]:
        """The stand-in's runner registrations."""
        assert self.standin is not None
        return list(self.standin.state.runners.values())

    def check_processes(self) -> None:
        """Raise ``RuntimeError`` naming a stack process that died."""
        if self.service is not None:
            self.service.supervise(restart=False)

    async def stop(self) -> None:
        """Stop everything (service, registry, stand-in). Idempotent."""
        await self.stop_service()
        await self.stop_fixtures()

    async def stop_service(self) -> None:
        if self._kube is not None:
            await self._kube.close()
            self._kube = None
        if self.service is not None:
            await self.service.stop()

    async def stop_fixtures(self) -> None:
        if self.registry is not None:
            await self.registry.stop()
            self.registry = None
        if self.standin is not None:
            await self.standin.stop()
            self.standin = None
        if self.devnet is not None:
            await asyncio.to_thread(self.devnet.delete)
            atexit.unregister(self.devnet.delete)
            self.devnet = None


async def wait_for(
    what: str, check: Any, seconds: float, stack: Stack | None = None, interval: float = 0.5
) -> Any:
    """Poll async ``check()`` until it returns a truthy value; raise ``TimeoutError`` naming
    ``what`` after ``seconds`` (and ``RuntimeError`` if a stack process died)."""
    deadline = time.monotonic() + seconds
    while True:
        if stack is not None:
            stack.check_processes()
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {seconds:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
