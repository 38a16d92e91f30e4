"""The embedded stack, shared by ``impvm dev up`` and the end-to-end tests.

Pieces, all real: a control plane (etcd + kube-apiserver + garbage collector) with the CRDs; the
GitHub stand-in (in this process) seeded with an App, its installation on ``my-org``, a
repository and the runner group ``omni-runner``; a loopback OCI registry with a busybox base image
and a runner layer whose ``run.sh`` is the stand-in runner, both pinned by digest; the App's
credentials Secret; the operator and one agent as separate processes (``impvm operator``,
``impvm agent``); and the seed's minimal example applied with the two image placeholders replaced
by the pushed digests.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Secret

from impvm.agent.process import host_python_binds
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.controlplane import ControlPlane, free_port
from impvm.devstack.kube import admin_client, install_crds, service_account_kubeconfig
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import TestImages, build_test_images

#: deploy/ of the source tree (the stack runs from a checkout: scripts/setup.sh installs it
#: editable)
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"

APP_ID = 4242
INSTALLATION_ID = 777
ORG = "my-org"
REPO = "my-org/app"
RUNNER_GROUP = "omni-runner"
CREDENTIALS_SECRET = "github-runner-app"
POOL = "ci-pool"
NAMESPACE = "default"
WEBHOOK_SECRET = "github-webhook"

#: Permissions the stand-in's installation grants (what impvm needs, nothing more).
INSTALLATION_PERMISSIONS = {
    "organization_self_hosted_runners": "write",
    "administration": "write",
    "actions": "read",
    "metadata": "read",
}

SEED_EXAMPLE = """\
apiVersion: imp.dev/v1alpha1
kind: ImpVMClass
metadata:
  name: runner-class
  namespace: default
spec:
  vcpu: 2
  memoryMiB: 2048
  diskGiB: 10
---
apiVersion: imp.dev/v1alpha1
kind: ImpVMTemplate
metadata:
  name: gh-runner
  namespace: default
spec:
  classRef:
    name: runner-class
  image: <immutable-runner-base-image>
  runnerLayer: <immutable-runner-layer-image>
---
apiVersion: imp.dev/v1alpha1
kind: ImpVMRunnerPool
metadata:
  name: ci-pool
  namespace: default
spec:
  templateName: gh-runner
  labels: [imp]
  platform:
    type: github-actions
    scope:
      org: my-org
    runnerGroup: omni-runner
    credentialsSecret: github-runner-app
    tokenSource: github_app
  scaling:
    mode: polling
    minIdle: 1
    maxConcurrent: 5
    scaleUpStep: 1
    cooldownSeconds: 30
    polling:
      enabled: true
      intervalSeconds: 30
"""


def random_webhook_secret() -> str:
    """A random webhook secret (URL-safe, 32 bytes of entropy)."""
    import secrets

    return secrets.token_urlsafe(32)


def seed_example(images: TestImages) -> str:
    """The seed's minimal example (seed 001) with the two image placeholders replaced."""
    return SEED_EXAMPLE.replace("<immutable-runner-base-image>", images.base).replace(
        "<immutable-runner-layer-image>", images.runner_layer
    )


@dataclass
class StackConfig:
    """What to start. ``runtime``: the agent's runtime; sizes in vCPU / MiB."""

    workdir: Path
    runtime: str = "process"
    agent_vcpu: int = 16
    agent_memory_mib: int = 32768
    polling_interval_seconds: int | None = None
    apply_example: bool = True
    #: scaling.mode of the example pool: the seed's polling, or webhook/hybrid (the stand-in then
    #: delivers signed workflow_job webhooks to the operator, losing ``webhook_drop_rate``)
    scaling_mode: str = "polling"
    webhook_drop_rate: float = 0.0
    #: start one agent (node-1); without it VMs are created but never run (benchmarks)
    start_agent: bool = True
    #: cosign binary the agent verifies signed images with (None: ``cosign`` on PATH), e.g.
    #: :func:`impvm.devstack.signing.cosign_binary`
    cosign: Path | None = None


@dataclass
class Stack:
    """The running stack. Use ``await Stack(cfg).start()`` and ``await stack.stop()``."""

    config: StackConfig
    control_plane: ControlPlane | None = None
    standin: StandIn | None = None
    registry: LocalRegistry | None = None
    images: TestImages | None = None
    kube: AsyncClient | None = None
    private_key_pem: str = field(default="", repr=False)
    webhook_secret: str = field(default="", repr=False)
    operator_http_port: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: kubeconfig per component (operator, agent), authenticating as its ServiceAccount
    kubeconfigs: dict[str, Path] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane is not None
        return self.control_plane.kubeconfig

    async def start(self) -> Stack:
        """Start every piece; raises on the first failure (call :meth:`stop` to clean up)."""
        wd = self.config.workdir
        wd.mkdir(parents=True, exist_ok=True)
        # a caller that dies without stop() must not leave the operator/agent behind
        atexit.register(self._kill_processes)
        self.control_plane = ControlPlane(workdir=wd / "controlplane")
        await asyncio.to_thread(self.control_plane.start)
        await asyncio.to_thread(install_crds, admin_client(self.control_plane.kubeconfig))
        self.kube = AsyncClient(
            config=KubeConfig.from_file(str(self.control_plane.kubeconfig)),
            field_manager="impvm-devstack",
        )
        await self._ensure_namespace("impvm-system")

        self.standin = StandIn()
        await self.standin.start()
        if self.config.runtime == "qemu":
            # QEMU user-mode networking: the guest reaches the host's loopback as 10.0.2.2
            self.standin.state.runner_base_url = f"http://10.0.2.2:{self.standin.port}"
        self._seed_github()

        self.registry = LocalRegistry(storage_dir=wd / "registry")
        await self.registry.start()
        self.images = await build_test_images(wd / "images", self.registry.address)

        await self._write_credentials()
        await self._apply_rbac()
        if self.config.start_agent:
            self.start_agent("node-1")
        self.start_operator()
        if self.config.scaling_mode in ("webhook", "hybrid"):
            await self._setup_webhooks()
        if self.config.apply_example:
            await self.apply_example()
        return self

    def _seed_github(self) -> None:
        assert self.standin is not None
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.private_key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        ).decode()
        st = self.standin.state
        st.add_app(APP_ID, self.private_key_pem)
        st.add_org(ORG)
        st.add_repo(REPO)
        st.add_runner_group(ORG, RUNNER_GROUP)
        st.add_installation(INSTALLATION_ID, APP_ID, ORG, INSTALLATION_PERMISSIONS)

    async def _apply_rbac(self) -> None:
        """Apply deploy/rbac/{operator,agent}.yaml and write a kubeconfig per component that
        authenticates as its ServiceAccount (TokenRequest): the operator and agent processes run
        with exactly the permissions a real deployment grants them."""
        assert self.kube is not None and self.control_plane is not None
        from lightkube.codecs import load_all_yaml

        for component in ("operator", "agent"):
            path = DEPLOY / "rbac" / f"{component}.yaml"
            for obj in load_all_yaml(path.read_text()):
                await self.kube.apply(obj, force=True)
            cfg = await asyncio.to_thread(
                service_account_kubeconfig,
                admin_client(self.control_plane.kubeconfig),
                self.control_plane.kubeconfig,
                "impvm-system",
                f"impvm-{component}",
                False,
            )
            out = self.config.workdir / f"{component}.kubeconfig"
            out.write_text(yaml.safe_dump(cfg))
            out.chmod(0o600)
            self.kubeconfigs[component] = out

    async def _ensure_namespace(self, name: str) -> None:
        assert self.kube is not None
        try:
            await self.kube.create(Namespace(metadata=ObjectMeta(name=name)))
        except ApiError as e:
            if e.status.code != 409:
                raise

    async def _write_credentials(self, namespace: str = NAMESPACE) -> None:
        assert self.kube is not None
        data = {
            "github_app_id": str(APP_ID),
            "github_app_installation_id": str(INSTALLATION_ID),
            "github_app_private_key": self.private_key_pem,
        }
        await self.kube.create(
            Secret(
                metadata=ObjectMeta(name=CREDENTIALS_SECRET, namespace=namespace),
                type="Opaque",
                data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
            )
        )

    async def _setup_webhooks(self, namespace: str = NAMESPACE) -> None:
        assert self.kube is not None and self.standin is not None
        self.webhook_secret = random_webhook_secret()
        await self.kube.create(
            Secret(
                metadata=ObjectMeta(name=WEBHOOK_SECRET, namespace=namespace),
                type="Opaque",
                data={"webhook_secret": base64.b64encode(self.webhook_secret.encode()).decode()},
            )
        )
        self.standin.add_webhook(
            f"http://127.0.0.1:{self.operator_http_port}/webhooks/github",
            self.webhook_secret,
            self.config.webhook_drop_rate,
        )

    async def apply_example(self) -> None:
        """Apply the seed's minimal example (three documents) with the pushed digests."""
        assert self.kube is not None and self.images is not None
        from lightkube.codecs import load_all_yaml

        docs = list(yaml.safe_load_all(seed_example(self.images)))
        scaling = docs[2]["spec"]["scaling"]
        if self.config.polling_interval_seconds is not None:
            scaling["polling"]["intervalSeconds"] = self.config.polling_interval_seconds
        scaling["mode"] = self.config.scaling_mode
        if self.config.scaling_mode in ("webhook", "hybrid"):
            scaling["webhook"] = {"secretRef": {"name": WEBHOOK_SECRET}}
        if self.config.scaling_mode == "webhook":
            del scaling["polling"]
        for obj in load_all_yaml(yaml.safe_dump_all(docs)):
            await self.kube.apply(obj, force=True)

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
        """Apply another pool from the example's template (same org, group and credentials)."""
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
        doc = {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVMRunnerPool",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "templateName": "gh-runner",
                "labels": labels,
                "platform": {
                    "type": "github-actions",
                    "scope": {"org": ORG},
                    "runnerGroup": RUNNER_GROUP,
                    "credentialsSecret": CREDENTIALS_SECRET,
                    "tokenSource": "github_app",
                },
                "scaling": scaling,
                **(extra or {}),
            },
        }
        await self.kube.create(ImpVMRunnerPoolResource.from_dict(doc))

    # ------------------------------------------------------------------ processes

    def _env(self, component: str) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfigs.get(component, self.kubeconfig))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, args: list[str], component: str) -> None:
        log: IO[bytes] = open(self.config.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "impvm.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(component),
            start_new_session=True,
        )
        log.close()

    def start_agent(self, node: str) -> None:
        """Start (or restart) the agent process for ``node``."""
        assert self.registry is not None
        args = [
            "agent",
            "--node-name",
            node,
            "--runtime",
            self.config.runtime,
            "--vcpu",
            str(self.config.agent_vcpu),
            "--memory-mib",
            str(self.config.agent_memory_mib),
            "--workdir",
            str(self.config.workdir / f"agent-{node}"),
            "--insecure-registry",
            self.registry.address,
        ]
        for p in host_python_binds():
            args += ["--bind-ro", str(p)]
        if self.config.cosign is not None:
            args += ["--cosign", str(self.config.cosign)]
        self._spawn(f"agent-{node}", args, "agent")

    def start_operator(self) -> None:
        """Start (or restart) the operator process."""
        assert self.standin is not None
        if not self.operator_http_port:
            self.operator_http_port = free_port()
        self._spawn(
            "operator",
            [
                "operator",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.operator_http_port),
                "--github-api-url",
                self.standin.url,
                "--node-lost-grace-seconds",
                "5",
            ],
            "operator",
        )

    def _kill_processes(self) -> None:
        for name in list(self.procs):
            with contextlib.suppress(Exception):
                self.kill(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one process (``operator`` or ``agent-<node>``) and wait for it."""
        p = self.procs.pop(name, None)
        if p and p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(timeout=30)

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
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.config.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")

    async def stop(self) -> None:
        """Stop everything (processes, registry, stand-in, control plane). Idempotent."""
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        if self.kube is not None:
            await self.kube.close()
            self.kube = None
        if self.registry is not None:
            await self.registry.stop()
            self.registry = None
        if self.standin is not None:
            await self.standin.stop()
            self.standin = None
        if self.control_plane is not None:
            await asyncio.to_thread(self.control_plane.stop)


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
