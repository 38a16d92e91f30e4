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
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig

from impvm.agent.qemu import kill_all_recorded
from impvm.kube.admin import admin_client, install_crds
from impvm.kube.controlplane import ControlPlane
from impvm.up.apply import (
    apply_admission,
    apply_objects,
    apply_rbac,
    apply_secrets,
    ensure_namespace,
    prune,
)
from impvm.up.cmdline import agent_args, operator_args
from impvm.up.config import UpConfig
from impvm.up.manifests import SYSTEM_NAMESPACE
from impvm.up.tokens import api_token_path, write_agent_kubeconfig, write_agent_tokens

FIELD_MANAGER = "impvm-up"


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
            await ensure_namespace(self.kube, ns)
        await self._apply_rbac()
        await apply_admission(self.kube)
        await apply_secrets(self.kube, self.config)
        await apply_objects(self.kube, self.config, self.source, dry_run=True)
        if start_agent:
            self.start_agent()
        self.start_operator()
        await apply_objects(self.kube, self.config, self.source, dry_run=False)
        await prune(self.kube, self.config)
        return self

    async def _apply_rbac(self) -> None:
        """The components' ServiceAccounts and roles (deploy/rbac) and a kubeconfig per
        component that acts as its ServiceAccount: the processes get exactly what a cluster
        deployment grants them. The
        agent's is a token bound to its Node object, as a DaemonSet pod's is bound to its pod:
        without a node name the admission policies refuse its every write."""
        assert self.kube is not None and self.control_plane is not None
        await apply_rbac(self.kube)
        sa = f"system:serviceaccount:{SYSTEM_NAMESPACE}:impvm-operator"
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM_NAMESPACE}"]
        path = self.data_dir / "operator.kubeconfig"
        await asyncio.to_thread(self.control_plane.client_kubeconfig, path, sa, groups)
        self.kubeconfigs["operator"] = path
        self.kubeconfigs["agent"] = await asyncio.to_thread(self.agent_kubeconfig, self.node_name)

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
        node = node or self.node_name
        args = agent_args(
            self.config,
            self.data_dir,
            node,
            own_node=node == self.node_name,
            token_file=self._token(node),
        )
        self._spawn(f"agent-{node}", args, self.agent_kubeconfig(node))

    def agent_kubeconfig(self, node: str) -> Path:
        """The kubeconfig of ``node``'s agent (written when missing): the API server, and a
        token file the agent re-reads when the API server refuses a token (lightkube's
        ``tokenFile``) that :meth:`_token` keeps fresh."""
        assert self.control_plane is not None, "start() first"
        if not api_token_path(self.data_dir, node).is_file():
            self._token(node)
        return write_agent_kubeconfig(self.control_plane, self.data_dir, node)

    def _token(self, node: str) -> Path:
        """Write the agent's two node-bound tokens for ``node``
        (:func:`~impvm.up.tokens.write_agent_tokens`), valid a day; :meth:`supervise` renews
        them hourly. Returns the hand-out token's file (0600)."""
        assert self.control_plane is not None, "start() first"
        path = write_agent_tokens(self.control_plane, self.data_dir, node)
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
        args = operator_args(self.config, host, port)
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
