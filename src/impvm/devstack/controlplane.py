"""A real Kubernetes control plane for tests and the embedded stack: etcd + kube-apiserver (RBAC on)
+ kube-controller-manager running only the garbage collector and namespace controllers.

Binaries are found through ``KUBEBUILDER_ASSETS`` (the envtest convention) or built once from Go
modules by ``assets/build-control-plane.sh`` into ``~/.cache/impvm/control-plane/``. Flags follow
controller-runtime's envtest. Certificates (CA, serving, admin client with ``system:masters``) and
the service-account signing key are generated per start with ``cryptography``.
"""

from __future__ import annotations

import atexit
import datetime as dt
import ipaddress
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
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")


class ControlPlaneError(RuntimeError):
    """The control plane could not be found, built or started."""


def build_script() -> Path:
    """Path of the shipped build script for the control-plane binaries."""
    return Path(str(resources.files("impvm.devstack") / "assets" / "build-control-plane.sh"))


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


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
    client: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                ]
            ),
            critical=False,
        )
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if usages:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


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
    api_port: int = 0
    etcd_port: int = 0
    #: kube-apiserver's --bind-address (0.0.0.0: every host address, kube-apiserver's default)
    bind_address: str = "127.0.0.1"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubectl(self) -> Path:
        """The kubectl built with the control plane."""
        assert self.assets is not None, "start() first"
        return self.assets / "kubectl"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    def _write_pki(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        ca_key = _key()
        ca_name = _name("impvm-test-ca")
        ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        srv_key = _key()
        srv = _cert(_name("kube-apiserver"), srv_key, ca_name, ca_key, server=True)
        adm_key = _key()
        adm = _cert(_name("impvm-admin", "system:masters"), adm_key, ca_name, ca_key, client=True)
        sa_key = _key()
        files = {
            "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
            "ca.key": _pem_key(ca_key),
            "apiserver.crt": srv.public_bytes(serialization.Encoding.PEM),
            "apiserver.key": _pem_key(srv_key),
            "admin.crt": adm.public_bytes(serialization.Encoding.PEM),
            "admin.key": _pem_key(adm_key),
            "sa.key": _pem_key(sa_key),
            "sa.pub": sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        }
        for name, data in files.items():
            p = pki / name
            p.write_bytes(data)
            p.chmod(0o600)

    def _write_kubeconfig(self) -> None:
        pki = self.workdir / "pki"
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "impvm",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate": str(pki / "admin.crt"),
                        "client-key": str(pki / "admin.key"),
                    },
                }
            ],
            "contexts": [
                {"name": "impvm", "context": {"cluster": "impvm", "user": "admin"}},
            ],
            "current-context": "impvm",
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg))
        self.kubeconfig.chmod(0o600)

    def _spawn(self, name: str, args: list[str]) -> None:
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
        assets = self.assets = self.assets or find_assets()
        atexit.register(self.stop)  # never leave etcd/kube-apiserver running behind a crash
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_pki()
        pki = self.workdir / "pki"
        self.etcd_port = free_port()
        peer_port = free_port()
        self.api_port = free_port()
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self._spawn(
            "etcd",
            [
                str(assets / "etcd"),
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
                "--log-level",
                "warn",
            ],
        )
        self._wait("etcd", lambda: urllib.request.urlopen(etcd_url + "/health", timeout=2))  # noqa: S310
        self._write_kubeconfig()
        self._spawn(
            "kube-apiserver",
            [
                str(assets / "kube-apiserver"),
                "--etcd-servers",
                etcd_url,
                "--bind-address",
                self.bind_address,
                "--secure-port",
                str(self.api_port),
                "--cert-dir",
                str(pki),
                "--tls-cert-file",
                str(pki / "apiserver.crt"),
                "--tls-private-key-file",
                str(pki / "apiserver.key"),
                "--client-ca-file",
                str(pki / "ca.crt"),
                "--authorization-mode",
                "RBAC",
                "--service-cluster-ip-range",
                "10.0.0.0/24",
                "--allow-privileged=true",
                "--disable-admission-plugins",
                "ServiceAccount",
                "--service-account-issuer",
                f"https://127.0.0.1:{self.api_port}/",
                "--service-account-key-file",
                str(pki / "sa.pub"),
                "--service-account-signing-key-file",
                str(pki / "sa.key"),
                "--v",
                "1",
            ],
        )
        self._wait("kube-apiserver", lambda: self._https_ok("/readyz"))
        self._spawn(
            "kube-controller-manager",
            [
                str(assets / "kube-controller-manager"),
                "--kubeconfig",
                str(self.kubeconfig),
                "--controllers",
                "garbagecollector,namespace",
                "--leader-elect=false",
                "--secure-port",
                "0",
                "--concurrent-gc-syncs",
                "5",
                "--v",
                "1",
            ],
        )
        # kcm needs a moment to build its GC graph; callers that depend on cascades wait for them.
        time.sleep(0.5)
        if self.procs["kube-controller-manager"].poll() is not None:
            tail = (self.workdir / "kube-controller-manager.log").read_text()[-3000:]
            raise ControlPlaneError(f"kube-controller-manager exited:\n{tail}")
        return self

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
