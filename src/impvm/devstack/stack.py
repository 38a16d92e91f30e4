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
import base64
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from impvm.agent.process import host_python_binds
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.devstack.netns import DevNetwork
from impvm.devstack.registry import LocalRegistry
from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import TestImages, build_test_images
from impvm.kube.controlplane import ControlPlane, free_port, write_private
from impvm.up.config import APP_SECRET, WEBHOOK_SECRET, load_config
from impvm.up.service import Service

APP_ID = 4242
INSTALLATION_ID = 777
ORG = "my-org"
REPO = "my-org/app"
RUNNER_GROUP = "omni-runner"
CREDENTIALS_SECRET = APP_SECRET
POOL = "ci-pool"
NAMESPACE = "default"

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


def example_scaling() -> dict[str, Any]:
    """``spec.scaling`` of the example pool (a fresh copy)."""
    docs = list(yaml.safe_load_all(SEED_EXAMPLE))
    scaling: dict[str, Any] = docs[2]["spec"]["scaling"]
    return scaling


def make_private_key(pkcs8: bool = False) -> str:
    """A fresh 2048-bit RSA key as PEM (PKCS#1 by default, PKCS#8 with ``pkcs8``): an App's."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    fmt = (
        serialization.PrivateFormat.PKCS8
        if pkcs8
        else serialization.PrivateFormat.TraditionalOpenSSL
    )
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()).decode()


def app_secret(
    name: str,
    namespace: str,
    app_id: int,
    installation_id: int,
    private_key: str | None,
    **override: str | None,
) -> Secret:
    """A pool's credentials Secret for a GitHub App (keys as docs/architecture.md names them);
    ``override`` replaces keys (None drops one)."""
    data: dict[str, str | None] = {
        "github_app_id": str(app_id),
        "github_app_installation_id": str(installation_id),
        "github_app_private_key": private_key,
        **override,
    }
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items() if v is not None}
    return Secret(metadata=ObjectMeta(name=name, namespace=namespace), type="Opaque", data=encoded)


def pool_manifest(
    name: str,
    namespace: str,
    scaling: dict[str, Any],
    *,
    labels: list[str] | None = None,
    template: str = "gh-runner",
    org: str = ORG,
    runner_group: str | None = RUNNER_GROUP,
    credentials_secret: str = CREDENTIALS_SECRET,
    **spec: Any,
) -> dict[str, Any]:
    """An ImpVMRunnerPool in ``namespace`` registering in ``org`` with the App's credentials;
    ``spec`` adds top-level spec fields."""
    platform: dict[str, Any] = {
        "type": "github-actions",
        "scope": {"org": org},
        "credentialsSecret": credentials_secret,
        "tokenSource": "github_app",
    }
    if runner_group is not None:
        platform["runnerGroup"] = runner_group
    return {
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVMRunnerPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "templateName": template,
            "labels": ["imp"] if labels is None else labels,
            "platform": platform,
            "scaling": scaling,
            **spec,
        },
    }


def seed_github(
    standin: StandIn,
    private_key_pem: str,
    *,
    app_id: int = APP_ID,
    installation_id: int = INSTALLATION_ID,
    org: str = ORG,
) -> None:
    """Give the stand-in the App (its public key), the organisation with the repository
    ``ORG/app`` and the runner group, and the App's installation there with the permissions
    impvm needs."""
    st = standin.state
    st.add_app(app_id, private_key_pem)
    st.add_org(org)
    st.add_repo(f"{org}/app")
    st.add_runner_group(org, RUNNER_GROUP)
    st.add_installation(installation_id, app_id, org, INSTALLATION_PERMISSIONS)


def random_webhook_secret() -> str:
    """A random webhook secret (URL-safe, 32 bytes of entropy)."""
    import secrets

    return secrets.token_urlsafe(32)


def seed_example(images: TestImages) -> str:
    """The minimal example of the runner-pool docs with the two image placeholders replaced."""
    return SEED_EXAMPLE.replace("<immutable-runner-base-image>", images.base).replace(
        "<immutable-runner-layer-image>", images.runner_layer
    )


def dev_config(
    *,
    workdir: Path,
    standin_url: str,
    key_file: Path,
    registry: str,
    images: TestImages | None,
    operator_port: int,
    agent_metrics_port: int = 0,
    runtime: str = "process",
    agent_vcpu: int = 16,
    agent_memory_mib: int = 32768,
    scaling_mode: str = "polling",
    polling_interval_seconds: int | None = None,
    webhook_secret_file: Path | None = None,
    devnet: DevNetwork | None = None,
    cosign: Path | None = None,
) -> dict[str, Any]:
    """The ``impvm.yaml`` of the development stack (see :mod:`impvm.up.config`): the stand-in
    as GitHub, the loopback registry, the process runtime's host binds, throwaway etcd data, and
    (``images`` given) the minimal example as its class, template and pool, the pool using
    ``scaling_mode`` (the example's polling by default). ``devnet``: VMs on isolated networks
    that reach the stand-in there; without it VMs share the host's network. ``cosign``: the
    agent's cosign binary (None: on PATH)."""
    cfg: dict[str, Any] = {
        "dataDir": str(workdir),
        "github": {
            "apiURL": standin_url,
            "app": {
                "id": APP_ID,
                "installationId": INSTALLATION_ID,
                "privateKeyFile": str(key_file),
            },
        },
        "operator": {"listen": f"127.0.0.1:{operator_port}", "nodeLostGraceSeconds": 5},
        "agent": {
            "runtime": runtime,
            "nodeName": "node-1",
            "vcpu": agent_vcpu,
            "memoryMiB": agent_memory_mib,
            "insecureRegistries": [registry],
            "readOnlyBinds": [str(p) for p in host_python_binds()],
            "metricsListen": f"127.0.0.1:{agent_metrics_port or free_port()}",
            **({"cosign": str(cosign)} if cosign is not None else {}),
        },
        "kubernetes": {"apiPort": 0, "namespace": NAMESPACE, "etcdFsync": False},
    }
    if devnet is not None:
        # no resolver: the stand-in is reached by address
        cfg["agent"].update(
            guestNetwork="isolated",
            guestSubnet=devnet.guest_subnet,
            networkTable=devnet.table,
            networkPrefix=devnet.ifprefix,
            guestDns=["none"],
        )
    else:
        cfg["agent"]["guestNetwork"] = "unisolated"
    if webhook_secret_file is not None:
        cfg["github"]["webhookSecretFile"] = str(webhook_secret_file)
    if images is not None:
        docs = list(yaml.safe_load_all(seed_example(images)))
        objects: dict[str, dict[str, Any]] = {
            "ImpVMClass": {},
            "ImpVMTemplate": {},
            "ImpVMRunnerPool": {},
        }
        for d in docs:
            objects[d["kind"]][d["metadata"]["name"]] = d["spec"]
        pool = objects["ImpVMRunnerPool"][POOL]
        scaling = pool["scaling"]
        if polling_interval_seconds is not None:
            scaling["polling"]["intervalSeconds"] = polling_interval_seconds
        scaling["mode"] = scaling_mode
        if scaling_mode in ("webhook", "hybrid"):
            scaling["webhook"] = {"secretRef": {"name": WEBHOOK_SECRET}}
        if scaling_mode == "webhook":
            del scaling["polling"]
        cfg["classes"] = objects["ImpVMClass"]
        cfg["templates"] = objects["ImpVMTemplate"]
        cfg["pools"] = objects["ImpVMRunnerPool"]
    return cfg


@dataclass
class StackConfig:
    """What to start. ``runtime``: the agent's runtime; sizes in vCPU / MiB."""

    workdir: Path
    runtime: str = "process"
    agent_vcpu: int = 16
    agent_memory_mib: int = 32768
    polling_interval_seconds: int | None = None
    apply_example: bool = True
    #: scaling.mode of the example pool: the example's polling, or webhook/hybrid (the stand-in then
    #: delivers signed workflow_job webhooks to the operator, losing ``webhook_drop_rate``)
    scaling_mode: str = "polling"
    webhook_drop_rate: float = 0.0
    #: start one agent (node-1); without it VMs are created but never run (benchmarks)
    start_agent: bool = True
    #: cosign binary the agent verifies signed images with (None: ``cosign`` on PATH), e.g.
    #: :func:`impvm.signing.cosign.cosign_binary`
    cosign: Path | None = None
    #: guests on isolated networks, the stand-in in its own "internet" namespace
    #: (:class:`impvm.devstack.netns.DevNetwork`; needs root); None: when running as root
    isolated_network: bool | None = None


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
