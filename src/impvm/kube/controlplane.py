"""A real Kubernetes control plane for tests and the embedded stack: etcd + kube-apiserver (RBAC on)
+ kube-controller-manager running only the garbage collector and namespace controllers.

With ``for_nodes`` it is the control plane of a cluster with real kubelets (the test cluster,
``impvm.devstack.cluster``), configured as kubeadm configures one: authorization ``Node,RBAC``,
the NodeRestriction and ServiceAccount admission plugins, kube-controller-manager with its
default controllers acting through one ServiceAccount each (``--use-service-account-credentials``),
and kube-scheduler; each component authenticates as its own user (``system:kube-scheduler``,
``system:kube-controller-manager``), and the API server reaches kubelets with a client
certificate of its own.

Binaries are found through ``KUBEBUILDER_ASSETS`` (the envtest convention) or built once from Go
modules by ``assets/build-control-plane.sh`` into ``~/.cache/impvm/control-plane/``. Flags follow
controller-runtime's envtest. Certificates (CA, serving, admin client with ``system:masters``) and
the service-account signing key are generated with ``cryptography``: per start for a throwaway
control plane, once for a ``persistent`` one (``impvm up``), which also keeps its ports and etcd's
data (written with fsync) in ``workdir`` so a restart, or a reboot, carries on where it stopped.

Nothing it opens answers a local user who holds none of its keys (``pki/``, mode 0700):

* etcd's client URL (KV API, JSON gateway, ``/metrics``, ``/health``) and its peer URL are
  HTTPS on loopback with client certificates required (``--client-cert-auth``,
  ``--peer-client-cert-auth``), from an etcd CA of their own that signs only etcd's, the API
  server's (``--etcd-certfile``) and the peer certificate - a Kubernetes client certificate is
  no etcd credential (kubeadm's ``etcd/ca`` layout);
* kube-apiserver: TLS on ``bind_address`` (loopback by default), no anonymous requests
  (``--anonymous-auth=false``: even ``/healthz`` and ``/version`` need a credential), RBAC;
* kube-controller-manager serves no port (``--secure-port 0``).

Secrets are encrypted at rest: kube-apiserver gets an ``EncryptionConfiguration`` (Kubernetes
docs, "Encrypting Confidential Data at Rest") with the ``secretbox`` provider (XSalsa20 +
Poly1305) and a 32-byte key made once in ``pki/`` (0600), so the App's private key and the JIT
configs are never in etcd's files in clear; a data directory from before gets its Secrets
written again, encrypted, at the first start with the key. The key file sits beside the CA key:
whoever can read one can read the other.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from impvm.kube import cpflags as flags
from impvm.kube import pki as certs
from impvm.kube.pki import KUBELET_CLIENT_USER, write_private

__all__ = ["KUBELET_CLIENT_USER", "ControlPlane", "ControlPlaneError", "free_port", "write_private"]

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")


class ControlPlaneError(RuntimeError):
    """The control plane could not be found, built or started."""


def build_script() -> Path:
    """Path of the shipped build script for the control-plane binaries."""
    return Path(str(resources.files("impvm.kube") / "assets" / "build-control-plane.sh"))


def find_assets(build: bool = True) -> Path:
    """Directory holding etcd, kube-apiserver and kube-controller-manager.

    ``KUBEBUILDER_ASSETS`` wins; otherwise the build script's cache, built when missing (minutes on
    2 cores the first time). Raises :class:`ControlPlaneError` when neither works.
    """
    env = os.environ.get("KUBEBUILDER_ASSETS")
    if env:
        path = Path(env)
        missing = [b for b in BINARIES if not (path / b).is_file()]
        if missing:
            raise ControlPlaneError(f"KUBEBUILDER_ASSETS={env} lacks {', '.join(missing)}")
        return path
    if not build:
        raise ControlPlaneError("KUBEBUILDER_ASSETS is not set and building is disabled")
    proc = subprocess.run(
        ["bash", str(build_script())], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ControlPlaneError("building the control plane failed:\n" + proc.stderr[-4000:])
    return Path(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager (GC, namespace) under ``workdir``.

    ``start()`` blocks until the API server is ready (raises :class:`ControlPlaneError` after
    ``timeout`` seconds); ``stop()`` ends every process. ``kubeconfig`` is an admin kubeconfig
    (client certificate in ``system:masters``).
    """

    workdir: Path
    assets: Path | None = None
    timeout: float = 90.0
    #: kube-apiserver port; 0: a free one (chosen once and kept when ``persistent``)
    api_port: int = 0
    etcd_port: int = 0
    #: kube-apiserver's --bind-address (0.0.0.0: every host address, kube-apiserver's default)
    bind_address: str = "127.0.0.1"
    #: keep certificates, ports and etcd data across starts (``impvm up``)
    persistent: bool = False
    #: fsync etcd's writes (off for throwaway test data, where it only costs time)
    etcd_fsync: bool = False
    #: encrypt Secrets at rest (off only to make a data directory from before it, in tests)
    encrypt_secrets: bool = True
    #: the address clients and kubelets reach the API server at (kubeconfigs, certificates,
    #: the ``kubernetes`` Service's endpoint); loopback unless real nodes need another
    address: str = "127.0.0.1"
    #: the control plane of a cluster with real kubelets (see the module docstring)
    for_nodes: bool = False
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _argv: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.api_port}"

    @property
    def etcd_url(self) -> str:
        """etcd's client URL (HTTPS, client certificates required)."""
        return f"https://127.0.0.1:{self.etcd_port}"

    def etcd_tls(self) -> ssl.SSLContext:
        """A TLS context that trusts etcd's CA and presents the API server's etcd client
        certificate: what it takes to talk to this etcd (root, or whoever reads ``pki/``)."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "etcd-ca.crt"))
        ctx.load_cert_chain(str(self.pki / "apiserver-etcd-client.crt"),
                            str(self.pki / "apiserver-etcd-client.key"))  # fmt: skip
        return ctx

    @property
    def kubectl(self) -> Path:
        """The kubectl built with the control plane."""
        assert self.assets is not None, "start() first"
        return self.assets / "kubectl"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    def _encrypt_stored_secrets(self) -> int:
        """Write every Secret again, unchanged, so the API server stores it encrypted: a data
        directory from before encryption was on holds them in clear, and the ``identity``
        provider only reads them (Kubernetes docs, "Encrypting Confidential Data at Rest":
        ensure all Secrets are encrypted). Returns how many were written. Raises
        :class:`ControlPlaneError` when kubectl fails."""
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        got = subprocess.run(
            [str(self.kubectl), "get", "secrets", "--all-namespaces", "-o", "json"],
            capture_output=True,
            env=env,
        )
        if got.returncode != 0:
            raise ControlPlaneError(
                f"listing Secrets to encrypt them: {got.stderr.decode()[-500:]}"
            )
        listed = json.loads(got.stdout)
        if not listed.get("items"):
            return 0
        put = subprocess.run(
            [str(self.kubectl), "replace", "-f", "-"],
            input=got.stdout,
            capture_output=True,
            env=env,
        )
        if put.returncode != 0:  # kubectl's stderr names objects, never their data
            raise ControlPlaneError(f"encrypting stored Secrets: {put.stderr.decode()[-500:]}")
        return len(listed["items"])

    def serving_certificate(self, stem: str, addresses: tuple[str, ...]) -> tuple[Path, Path]:
        """A server certificate and key (``pki/<stem>.crt``, ``.key``) from this control plane's
        CA for ``addresses`` (IP addresses, plus ``localhost``), for servers beside the API
        server that clients verify with the cluster's CA (the test cluster's registry). Call
        after :meth:`start`."""
        return certs.issue(self.pki, stem, certs.name(stem), server=True, addresses=addresses)

    def client_kubeconfig(self, path: Path, user: str, groups: list[str]) -> Path:
        """Write a kubeconfig to ``path`` that authenticates as ``user`` in ``groups`` with a
        client certificate from this control plane's CA (Kubernetes takes the user name from
        the CN and the groups from the O fields, "X509 client certificates" in the
        authentication docs). For ``system:serviceaccount:NS:NAME`` with the service-account
        groups this is that ServiceAccount to RBAC, without a token that expires. The
        certificate is issued once and again when expiring. Call after :meth:`start`."""
        stem = "client-" + "".join(c if c.isalnum() else "-" for c in user)
        crt, key_path = self.pki / f"{stem}.crt", self.pki / f"{stem}.key"
        if not certs.fresh(crt, key_path):
            days = certs.LEAF_DAYS if self.persistent else 30
            certs.issue(self.pki, stem, certs.name(user, groups), client=True, days=days)
        cfg = self._kubeconfig_dict(
            "sa", {"client-certificate": str(crt), "client-key": str(key_path)}
        )
        write_private(path, yaml.safe_dump(cfg).encode())
        return path

    def token_kubeconfig(self, token_file: Path) -> dict[str, object]:
        """A kubeconfig (as a dict) of this API server whose credential is the bearer token in
        ``token_file`` (``tokenFile``: clients read it again when a token is refused, so the
        file can be renewed in place, like a projected ServiceAccount token)."""
        return self._kubeconfig_dict("sa", {"tokenFile": str(token_file)})

    def _ports(self) -> tuple[int, int, int]:
        """(api, etcd client, etcd peer) ports: kept in ``ports.json`` when persistent (etcd
        records its peer URL with its data, and kubeconfigs name the API port)."""
        saved = self.workdir / "ports.json"
        if self.persistent and saved.is_file():
            p = json.loads(saved.read_text())
            api = self.api_port or int(p["api"])
            return api, int(p["etcd"]), int(p["peer"])
        ports = (self.api_port or free_port(), free_port(), free_port())
        if self.persistent:
            saved.write_text(json.dumps(dict(zip(("api", "etcd", "peer"), ports, strict=True))))
        return ports

    def _kubeconfig_dict(self, user: str, credentials: dict[str, str]) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "impvm",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.pki / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "impvm", "context": {"cluster": "impvm", "user": user}}],
            "current-context": "impvm",
        }

    def _write_kubeconfig(self) -> None:
        cfg = self._kubeconfig_dict(
            "admin",
            {
                "client-certificate": str(self.pki / "admin.crt"),
                "client-key": str(self.pki / "admin.key"),
            },
        )
        write_private(self.kubeconfig, yaml.safe_dump(cfg).encode())

    def _spawn(self, name: str, args: list[str]) -> None:
        self._argv[name] = args
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _wait(self, what: str, check: object) -> None:
        deadline = time.monotonic() + self.timeout
        last = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise ControlPlaneError(f"{name} exited with {p.returncode}:\n{tail}")
            try:
                if check():  # type: ignore[operator]
                    return
            except Exception as e:  # readiness probe: any failure means "not yet"
                last = str(e)
            time.sleep(0.2)
        raise ControlPlaneError(f"{what} not ready after {self.timeout}s: {last}")

    def _https_ok(self, path: str) -> bool:
        pki = self.workdir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        with urllib.request.urlopen(self.url + path, context=ctx, timeout=5) as r:  # noqa: S310
            return bool(r.status == 200)

    def start(self) -> ControlPlane:
        """Start etcd, kube-apiserver and kube-controller-manager; return self when ready."""
        self.assets = self.assets or find_assets()
        atexit.register(self.stop)  # never leave etcd/kube-apiserver running behind a crash
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        certs.ensure_pki(
            self.pki, persistent=self.persistent, address=self.address, for_nodes=self.for_nodes
        )
        had_data = (self.workdir / "etcd" / "member").is_dir()
        encryption, new_key = (
            certs.ensure_encryption(self.pki, persistent=self.persistent)
            if self.encrypt_secrets
            else (None, False)
        )
        self.api_port, self.etcd_port, peer_port = self._ports()
        etcd_url = self.etcd_url
        peer_url = f"https://127.0.0.1:{peer_port}"
        self._spawn("etcd", flags.etcd(self, etcd_url, peer_url))
        tls = self.etcd_tls()
        self._wait(
            "etcd",
            lambda: urllib.request.urlopen(etcd_url + "/health", timeout=2, context=tls),  # noqa: S310
        )
        self._write_kubeconfig()
        self._spawn("kube-apiserver", flags.apiserver(self, encryption))
        self._wait("kube-apiserver", lambda: self._https_ok("/readyz"))
        if new_key and had_data:
            self._encrypt_stored_secrets()
        self._spawn("kube-controller-manager", flags.controller_manager(self))
        if self.for_nodes:
            self._spawn("kube-scheduler", flags.scheduler(self))
        # kcm needs a moment to build its GC graph; callers that depend on cascades wait for them.
        time.sleep(0.5)
        if self.procs["kube-controller-manager"].poll() is not None:
            tail = (self.workdir / "kube-controller-manager.log").read_text()[-3000:]
            raise ControlPlaneError(f"kube-controller-manager exited:\n{tail}")
        return self

    def dead(self) -> list[str]:
        """Names of the processes that exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def restart(self, name: str) -> None:
        """Start an exited process again with the arguments it had (same ports and data)."""
        self._spawn(name, self._argv[name])

    def stop(self) -> None:
        """Terminate every process (SIGTERM, then SIGKILL after 10 s)."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()

    def remove(self) -> None:
        """Stop and delete the working directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
