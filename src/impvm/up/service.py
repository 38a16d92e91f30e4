"""The single-machine service behind ``impvm up`` (and ``impvm dev up``, which is one
configuration of it): the embedded control plane with its state in the data directory, the
operator and one agent as processes acting as their ServiceAccounts, the App credentials and
webhook secret from files, and the classes, templates and pools of the configuration.

Data directory (mode 0700)::

    controlplane/        certificates (made once), etcd data, ports.json, component logs
    controlplane/kubeconfig   admin kubeconfig (kubectl --kubeconfig ... get imprp,impvm)
    operator.kubeconfig  the operator's identity (a client certificate of its ServiceAccount)
    agent-<node>.kubeconfig, agent-<node>-api.token   the agent's identity: a token of its
                         ServiceAccount bound to the Node object <node>, so the API server's
                         admission policies (deploy/admission) know which node writes
    agent-<node>.token   the agent's node-bound token for the operator's JIT config hand-out
    agent-<node>/        image cache and per-VM scratch
    operator.log, agent-<node>.log

Restarted, or after a reboot, everything comes back from there: etcd still holds the pools, VMs
and Secrets; the agent reports the VMs whose runtime died with it as Lost, the operator replaces
them and deletes their registrations (two-way reconciliation), and demand is read again from
GitHub. Nothing of it lives only in memory.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

import yaml
from lightkube import AsyncClient
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import ValidatingAdmissionPolicy
from lightkube.resources.core_v1 import Namespace, Secret
from lightkube.types import PatchType

from impvm.agent.qemu import kill_all_recorded
from impvm.api.models import AGENT_LEASE_NAMESPACE, JIT_HANDOUT_AUDIENCE
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.kube.admin import admin_client, install_crds, node_bound_token
from impvm.kube.controlplane import ControlPlane, write_private
from impvm.up.config import APP_SECRET, WEBHOOK_SECRET, ConfigError, UpConfig

FIELD_MANAGER = "impvm-up"
#: seconds an object is retried while an admission policy is still being configured
POLICY_READY_SECONDS = 120.0
POLICY_REQUEUE_SECONDS = 5.0
REQUEUED_ANNOTATION = "imp.dev/requeued-at"
#: label of the objects this service applies from its configuration (and prunes when they
#: leave it); objects applied with kubectl do not carry it and are left alone
MANAGED_BY = {"app.kubernetes.io/managed-by": "impvm-up"}
SYSTEM_NAMESPACE = AGENT_LEASE_NAMESPACE
COMPONENTS = ("operator", "agent")


def rbac_manifest(component: str) -> str:
    """deploy/rbac/<component>.yaml as shipped in the package (a verbatim copy)."""
    return (resources.files("impvm.up") / "assets" / "rbac" / f"{component}.yaml").read_text()


def policy_manifest() -> str:
    """deploy/admission/agent.yaml as shipped in the package (a verbatim copy): the admission
    policies that hold each agent to its own node."""
    return (resources.files("impvm.up") / "assets" / "admission" / "agent.yaml").read_text()


def admission_manifests() -> list[str]:
    """deploy/admission/*.yaml as shipped in the package (verbatim copies), by file name."""
    folder = resources.files("impvm.up") / "assets" / "admission"
    return [
        f.read_text()
        for f in sorted(folder.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".yaml")
    ]


def default_node_name() -> str:
    """``NODE_NAME``, else the host name made a valid object name."""
    name = os.environ.get("NODE_NAME") or socket.gethostname()
    clean = "".join(c if c.isalnum() or c in "-." else "-" for c in name.lower()).strip("-.")
    return clean[:63] or "node"


@dataclass
class _Restart:
    count: int = 0
    due: float = 0.0  # when a pending restart happens (0: none pending)
    started: float = 0.0  # when it was last restarted


@dataclass
class Service:
    """One machine's impvm. ``await start()``, then call :meth:`supervise` every second or so,
    and ``await stop()``. ``extra_env``: added to the operator's and agent's environment."""

    config: UpConfig
    source: str = "impvm.yaml"
    extra_env: dict[str, str] = field(default_factory=dict)
    control_plane: ControlPlane | None = None
    kube: AsyncClient | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    kubeconfigs: dict[str, Path] = field(default_factory=dict)
    #: process name -> (arguments, kubeconfig it runs with)
    _argv: dict[str, tuple[list[str], Path]] = field(default_factory=dict)
    _restarts: dict[str, _Restart] = field(default_factory=dict)
    #: node -> monotonic time its agent's hand-out token was last requested
    _tokens: dict[str, float] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    @property
    def node_name(self) -> str:
        return self.config.agent.node_name or default_node_name()

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (for kubectl)."""
        assert self.control_plane is not None, "start() first"
        return self.control_plane.kubeconfig

    @property
    def operator_port(self) -> int:
        return self.config.listen()[1]

    # ------------------------------------------------------------------ start

    async def start(self, *, start_agent: bool = True) -> Service:
        """Start the control plane, apply what the configuration holds, start the agent and
        the operator. Raises :class:`ConfigError` when the API server rejects an object of the
        configuration (nothing is started then but the control plane: call :meth:`stop`), and
        other exceptions on start-up failures."""
        data = self.data_dir
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(data, 0o700)  # etcd's data holds the App private key
        atexit.register(self._kill_processes)
        k = self.config.kubernetes
        self.control_plane = ControlPlane(
            workdir=data / "controlplane",
            persistent=True,
            api_port=k.api_port,
            etcd_fsync=k.etcd_fsync,
        )
        await asyncio.to_thread(self.control_plane.start)
        await asyncio.to_thread(install_crds, admin_client(self.control_plane.kubeconfig))
        self.kube = AsyncClient(
            config=KubeConfig.from_file(str(self.control_plane.kubeconfig)),
            field_manager=FIELD_MANAGER,
        )
        for ns in {SYSTEM_NAMESPACE, k.namespace}:
            await self._ensure_namespace(ns)
        await self._apply_rbac()
        await self._apply_admission()
        await self._apply_secrets()
        await self._apply_objects(dry_run=True)
        if start_agent:
            self.start_agent()
        self.start_operator()
        await self._apply_objects(dry_run=False)
        await self._prune()
        return self

    async def _ensure_namespace(self, name: str) -> None:
        assert self.kube is not None
        try:
            await self.kube.create(Namespace(metadata=ObjectMeta(name=name)))
        except ApiError as e:
            if e.status.code != 409:
                raise

    async def _apply_rbac(self) -> None:
        """The components' ServiceAccounts and roles (deploy/rbac) and a kubeconfig per
        component that acts as its ServiceAccount: the processes get exactly what a cluster
        deployment grants them. The
        agent's is a token bound to its Node object, as a DaemonSet pod's is bound to its pod:
        without a node name the admission policies refuse its every write."""
        assert self.kube is not None and self.control_plane is not None
        for component in COMPONENTS:
            for obj in load_all_yaml(rbac_manifest(component)):
                await self.kube.apply(obj, force=True)
        sa = f"system:serviceaccount:{SYSTEM_NAMESPACE}:impvm-operator"
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM_NAMESPACE}"]
        path = self.data_dir / "operator.kubeconfig"
        await asyncio.to_thread(self.control_plane.client_kubeconfig, path, sa, groups)
        self.kubeconfigs["operator"] = path
        self.kubeconfigs["agent"] = await asyncio.to_thread(self.agent_kubeconfig, self.node_name)

    async def _apply_admission(self) -> None:
        """The admission policies (deploy/admission: what an agent may write, which namespaces
        may use each class), the API server's own checks, applied before any object of the
        configuration and before an agent starts."""
        assert self.kube is not None
        for manifest in admission_manifests():
            for obj in load_all_yaml(manifest):
                await self.kube.apply(obj, force=True)

    async def _apply_secrets(self) -> None:
        """The App credentials (and webhook secret) from their files into Secrets of the
        pools' namespace, applied so a changed file updates them. The values are read here
        and sent to the API server only."""
        assert self.kube is not None
        gh = self.config.github
        ns = self.config.kubernetes.namespace
        app = {
            "github_app_id": str(gh.app.id),
            "github_app_installation_id": str(gh.app.installation_id),
            "github_app_private_key": gh.app.private_key_file.read_text(),
        }
        await self._apply_secret(APP_SECRET, ns, app)
        if gh.webhook_secret_file is not None:
            value = gh.webhook_secret_file.read_text().strip()
            await self._apply_secret(WEBHOOK_SECRET, ns, {"webhook_secret": value})

    async def _apply_secret(self, name: str, namespace: str, data: dict[str, str]) -> None:
        assert self.kube is not None
        secret = Secret(
            metadata=ObjectMeta(name=name, namespace=namespace, labels=dict(MANAGED_BY)),
            type="Opaque",
            data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        )
        await self.kube.apply(secret, force=True)

    def _objects(self) -> list[tuple[str, Any]]:
        """(config field, resource object) of every class, template and pool, in that order."""
        ns = self.config.kubernetes.namespace
        out: list[tuple[str, Any]] = []
        groups: list[tuple[str, str, Any, dict[str, Any], bool]] = [
            ("classes", "ImpVMClass", ImpVMClassResource, dict(self.config.classes), False),
            (
                "templates",
                "ImpVMTemplate",
                ImpVMTemplateResource,
                dict(self.config.templates),
                True,
            ),
            ("pools", "ImpVMRunnerPool", ImpVMRunnerPoolResource, dict(self.config.pools), True),
        ]
        for where, kind, res, specs, namespaced in groups:
            for name, spec in specs.items():
                meta: dict[str, Any] = {"name": name, "labels": dict(MANAGED_BY)}
                if namespaced:
                    meta["namespace"] = ns
                body = {
                    "apiVersion": "imp.dev/v1alpha1",
                    "kind": kind,
                    "metadata": meta,
                    "spec": spec.model_dump(by_alias=True, exclude_unset=True, mode="json"),
                }
                out.append((f"{where}.{name}", res.from_dict(body)))
        return out

    async def _apply_objects(self, *, dry_run: bool) -> None:
        """Server-side apply the configuration's objects (``dry_run``: only ask the API server
        whether it would accept them; its CEL rules are the API's own). Raises
        :class:`ConfigError` naming the object and the field the API server names."""
        assert self.kube is not None
        for where, obj in self._objects():
            deadline = time.monotonic() + POLICY_READY_SECONDS
            requeued = 0.0
            while True:
                try:
                    await self.kube.apply(obj, force=True, dry_run=dry_run)
                    break
                except ApiError as e:
                    if _policy_not_ready(e) and time.monotonic() < deadline:
                        # a started API server reads a policy's parameter kind (a CRD) a
                        # moment after it serves it: the object is not refused, only early
                        if time.monotonic() - requeued > POLICY_REQUEUE_SECONDS:
                            await self._requeue_policy(e)
                            requeued = time.monotonic()
                        await asyncio.sleep(0.5)
                        continue
                    if e.status.code not in (400, 422):
                        raise
                    raise ConfigError(f"{self.source}: {where}: {_one_line(e)}") from None

    async def _requeue_policy(self, e: ApiError) -> None:
        """Touch the admission policy ``e`` names (an annotation) so the API server configures
        it again now. Its policy controller retries a policy whose CRD ``paramKind`` it did not
        find yet with exponential backoff and otherwise only when the policy changes; after an
        API server restart that backoff outlasts any wait (kubernetes/kubernetes issues
        122658 and 124237)."""
        assert self.kube is not None
        name = _policy_name(e)
        if name is None:
            return
        patch = {"metadata": {"annotations": {REQUEUED_ANNOTATION: f"{time.time():.3f}"}}}
        with contextlib.suppress(ApiError):
            await self.kube.patch(
                ValidatingAdmissionPolicy, name, patch, patch_type=PatchType.MERGE
            )

    async def _prune(self) -> None:
        """Delete objects an earlier configuration applied that this one no longer holds."""
        assert self.kube is not None
        ns = self.config.kubernetes.namespace
        keep: dict[Any, set[tuple[str | None, str]]] = {
            ImpVMRunnerPoolResource: {(ns, n) for n in self.config.pools},
            ImpVMTemplateResource: {(ns, n) for n in self.config.templates},
            ImpVMClassResource: {(None, n) for n in self.config.classes},
        }
        selector = dict(MANAGED_BY)
        for res, names in keep.items():
            kwargs: dict[str, Any] = {"labels": selector}
            if res is not ImpVMClassResource:
                kwargs["namespace"] = "*"
            async for obj in self.kube.list(res, **kwargs):
                meta = obj.metadata
                key = (meta.namespace, meta.name)
                if key not in names:
                    await self.kube.delete(res, meta.name, namespace=meta.namespace)

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, args: list[str], kubeconfig: Path) -> None:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["KUBECONFIG"] = str(kubeconfig)
        env["PYTHONUNBUFFERED"] = "1"
        self._argv[name] = (args, kubeconfig)
        log: IO[bytes] = open(self.data_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "impvm.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()

    def start_agent(self, node: str | None = None) -> None:
        """Start (or restart) the agent of ``node`` (default: the configured node)."""
        a = self.config.agent
        node = node or self.node_name
        args = [
            "agent",
            "--node-name",
            node,
            "--runtime",
            a.runtime,
            "--workdir",
            str(self.data_dir / f"agent-{node}"),
            "--image-cache-mib",
            str(a.image_cache_mib),
            "--lease-namespace",
            SYSTEM_NAMESPACE,
            "--qemu-accelerator",
            a.qemu_accelerator,
        ]
        if a.vcpu:
            args += ["--vcpu", str(a.vcpu)]
        if a.memory_mib:
            args += ["--memory-mib", str(a.memory_mib)]
        if a.qemu_kernel:
            args += ["--qemu-kernel", str(a.qemu_kernel)]
        if a.cosign:
            args += ["--cosign", str(a.cosign)]
        for r in a.insecure_registries:
            args += ["--insecure-registry", r]
        for p in a.read_only_binds:
            args += ["--bind-ro", str(p)]
        args += [
            "--guest-network",
            a.guest_network,
            "--guest-subnet",
            a.guest_subnet,
            "--network-table",
            a.network_table,
            "--network-prefix",
            a.network_prefix,
            "--metrics-address",
            # another node's agent on this machine (tests): a free port of its own
            a.metrics_listen
            if node == self.node_name
            else a.metrics_listen.rpartition(":")[0] + ":0",
        ]
        for d in a.guest_dns or []:
            args += ["--guest-dns", d]
        host, port = self.config.listen()
        url = f"http://{_near(host)}:{port}"
        args += ["--operator-url", url, "--token-file", str(self._token(node))]
        self._spawn(f"agent-{node}", args, self.agent_kubeconfig(node))

    def _token_path(self, node: str) -> Path:
        return self.data_dir / f"agent-{node}.token"

    def agent_kubeconfig(self, node: str) -> Path:
        """The kubeconfig of ``node``'s agent (written when missing): the API server, and a
        token file the agent re-reads when the API server refuses a token (lightkube's
        ``tokenFile``) that :meth:`_token` keeps fresh."""
        assert self.control_plane is not None, "start() first"
        path = self.data_dir / f"agent-{node}.kubeconfig"
        api_token = self._token_path(node).with_name(f"agent-{node}-api.token")
        if not api_token.is_file():
            self._token(node)
        cfg = self.control_plane.token_kubeconfig(api_token)
        write_private(path, yaml.safe_dump(cfg).encode())
        return path

    def _token(self, node: str) -> Path:
        """Write the agent's two tokens for ``node``, both of its ServiceAccount and bound to
        the Node object ``node`` (created when missing), so the API server vouches for the node
        (``authentication.kubernetes.io/node-name``), as for a DaemonSet pod's projected
        tokens: one for the API server (its admission policies judge the agent's writes by
        that node) and one with the audience of the operator's JIT config hand-out. Valid a
        day; :meth:`supervise` renews them hourly. Returns the hand-out token's file (0600)."""
        assert self.control_plane is not None, "start() first"
        admin = admin_client(self.control_plane.kubeconfig)
        path = self._token_path(node)
        for audience, dest in (
            (None, path.with_name(f"agent-{node}-api.token")),
            (JIT_HANDOUT_AUDIENCE, path),
        ):
            token = node_bound_token(
                admin, SYSTEM_NAMESPACE, "impvm-agent", node, audience, labels=dict(MANAGED_BY)
            )
            tmp = dest.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            os.replace(tmp, dest)  # the agent never reads half a token
        self._tokens[node] = time.monotonic()
        return path

    def _renew_tokens(self, now: float) -> None:
        for node, at in list(self._tokens.items()):
            if now - at > 3600 and f"agent-{node}" in self.procs:
                self._token(node)

    def start_operator(self, replica: int = 0, port: int | None = None) -> str:
        """Start (or restart) an operator replica: ``operator`` on the configured address, or
        ``operator-<replica>`` on ``port`` of the same host (the replicas elect a leader).
        Returns the process name."""
        host, listen_port = self.config.listen()
        port = listen_port if port is None else port
        name = "operator" if replica == 0 else f"operator-{replica}"
        args = [
            "operator",
            "--http-host",
            host,
            "--http-port",
            str(port),
            *self.config.operator.options(),
            "--advertise-url",
            f"http://{_near(host)}:{port}",
        ]
        if self.config.github.api_url:
            args += ["--github-api-url", self.config.github.api_url]
        self._spawn(name, args, self.kubeconfigs["operator"])
        return name

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process (``operator`` or ``agent-<node>``) and its session, and wait for
        it; it is not restarted by :meth:`supervise`."""
        p = self.procs.pop(name, None)
        self._argv.pop(name, None)
        if p and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def _kill_processes(self) -> None:
        agents = [n for n in self.procs if n.startswith("agent-")]
        for name in list(self.procs):
            with contextlib.suppress(Exception):
                self.kill(name)
        for name in agents:  # VMs outlive their agent: not this process's exit
            with contextlib.suppress(Exception):
                kill_all_recorded(self.data_dir / name)

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every process that exited, control plane included."""
        out = [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]
        if self.control_plane is not None:
            out += [(n, self.control_plane.procs[n].returncode) for n in self.control_plane.dead()]
        return out

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a process's log."""
        for d in (self.data_dir, self.data_dir / "controlplane"):
            f = d / f"{name}.log"
            if f.is_file():
                return f.read_text(errors="replace")[-chars:]
        return ""

    def supervise(self, restart: bool, now: float | None = None) -> list[str]:
        """Look after the processes. ``restart``: start a dead one again, after a backoff of
        1, 2, 4 … 60 s (reset once it ran for 10 minutes), and return what was done; otherwise
        raise ``RuntimeError`` naming the first dead process with its log tail."""
        now = time.monotonic() if now is None else now
        self._renew_tokens(time.monotonic())
        done: list[str] = []
        for r in self._restarts.values():
            if r.due == 0.0 and r.count and now - r.started > 600:
                r.count = 0  # ran for 10 minutes: a later crash starts the backoff afresh
        for name, code in self.dead():
            if not restart:
                raise RuntimeError(f"{name} exited with {code}:\n{self.log_tail(name)}")
            r = self._restarts.setdefault(name, _Restart())
            if r.due == 0.0:
                r.due = now + min(60.0, 2.0**r.count)
                done.append(f"{name} exited with {code}; restarting in {r.due - now:.0f}s")
                continue
            if now < r.due:
                continue
            r.count += 1
            r.due = 0.0
            r.started = now
            if self.control_plane is not None and name in self.control_plane.procs:
                self.control_plane.restart(name)
            else:
                args, kubeconfig = self._argv[name]
                self._spawn(name, args, kubeconfig)
            done.append(f"{name} restarted")
        return done

    async def stop(self, keep_vms: bool = False) -> None:
        """Stop the operator and agent (SIGTERM), then (unless ``keep_vms``) the VMs the agent
        left running, then the control plane. Idempotent; state stays in the data directory.
        ``qemu`` VMs outlive their agent: kept, they go on with their jobs and the next start's
        agent re-attaches them (an upgrade of ``impvm up``); stopped, the next agent reports
        them Failed."""
        agents = [n for n in self.procs if n.startswith("agent-")]
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        for name in agents if not keep_vms else ():
            await asyncio.to_thread(kill_all_recorded, self.data_dir / name)
        if self.kube is not None:
            await self.kube.close()
            self.kube = None
        if self.control_plane is not None:
            await asyncio.to_thread(self.control_plane.stop)


def _near(host: str) -> str:
    """How a process on this machine reaches a server listening on ``host`` (URL form)."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - the address it listens on, not ours
        host = "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _policy_not_ready(e: ApiError) -> bool:
    """Whether ``e`` is an admission policy that is not configured yet, not a refusal of the
    object: until the API server's REST mapper knows the policy's ``paramKind`` (a CRD) it
    denies every request the policy binds with "failed to configure policy", as 422 Invalid
    (the reason a ValidatingAdmissionPolicy denial defaults to) or 403 Forbidden (the reason a
    binding may name)."""
    return e.status.code in (403, 422) and "failed to configure policy" in (e.status.message or "")


def _policy_name(e: ApiError) -> str | None:
    """The admission policy a 403 names (``ValidatingAdmissionPolicy 'NAME' denied ...``)."""
    m = re.search(r"ValidatingAdmissionPolicy '([a-z0-9.-]+)'", e.status.message or "")
    return m.group(1) if m else None


def _one_line(e: ApiError) -> str:
    """The API server's message, on one line (it names the field: ``spec.scaling.minIdle:
    ...``)."""
    msg = e.status.message or str(e)
    return " ".join(msg.split())
