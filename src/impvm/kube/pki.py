"""The control plane's certificates and keys (:func:`ensure_pki`, :func:`issue`): a CA for the
API server and its clients, etcd's own CA (only what it signs may talk to etcd), the
service-account signing key, and the encryption key for Secrets at rest
(:func:`ensure_encryption`). Every private file is written 0600 (:func:`write_private`).
A persistent control plane keeps its CAs and keys across starts and issues a leaf again only
when it is missing or expiring."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: the user the API server's client certificate to kubelets names (bound to
#: ``system:kubelet-api-admin`` by the test cluster)
KUBELET_CLIENT_USER = "kube-apiserver-kubelet-client"


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


#: DNS names of the API server inside a cluster (its Service ``kubernetes`` in ``default``)
_SERVICE_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
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
    days: int = 30,
    addresses: tuple[str, ...] = (),
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        ips = dict.fromkeys(("127.0.0.1", "10.0.0.1", *addresses))
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.DNSName(n) for n in ("localhost", *_SERVICE_NAMES)),
                    *(x509.IPAddress(ipaddress.ip_address(a)) for a in ips),
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


def _name(cn: str, org: str | list[str] | None = None) -> x509.Name:
    """A subject; Kubernetes reads the user from CN and the groups from each O."""
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    for o in [org] if isinstance(org, str) else org or []:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o))
    return x509.Name(attrs)


#: validity of a persistent control plane's certificates (days); leaf certificates are issued
#: again at a start when fewer than RENEW_DAYS remain
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_DAYS = 30


def _fresh(cert_path: Path, key_path: Path) -> bool:
    """Whether a certificate and its key exist and the certificate is valid for RENEW_DAYS
    more days."""
    if not (cert_path.is_file() and key_path.is_file()):
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    return left > dt.timedelta(days=RENEW_DAYS)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (created with that mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def load_key(pki: Path, stem: str = "ca") -> rsa.RSAPrivateKey:
    """The private key ``pki/<stem>.key`` (a CA's)."""
    key = serialization.load_pem_private_key((pki / f"{stem}.key").read_bytes(), None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return key


def issue(
    pki: Path, stem: str, subject: x509.Name, *, days: int = LEAF_DAYS, **kind: Any
) -> tuple[Path, Path]:
    """A leaf certificate and key (``pki/<stem>.crt``, ``.key``, 0600) for ``subject`` from the
    CA in ``pki``; ``kind``: ``server``/``client``/``addresses`` as :func:`_cert` takes them."""
    crt, key_path = pki / f"{stem}.crt", pki / f"{stem}.key"
    key = _key()
    cert = _cert(subject, key, _name("impvm-ca"), load_key(pki), days=days, **kind)
    write_private(key_path, _pem_key(key))
    write_private(crt, cert.public_bytes(serialization.Encoding.PEM))
    return crt, key_path


def fresh(crt: Path, key_path: Path) -> bool:
    """Whether a certificate and its key exist and are not near expiry."""
    return _fresh(crt, key_path)


def name(cn: str, org: str | list[str] | None = None) -> x509.Name:
    """A subject: CN (the user to Kubernetes) and O fields (its groups)."""
    return _name(cn, org)


def ensure_pki(pki: Path, *, persistent: bool, address: str, for_nodes: bool) -> None:
    """CA, service-account key, serving and admin certificates in ``pki`` (``address``: the
    API server's, in its serving certificate; ``for_nodes``: also the API server's client
    certificate to kubelets). A persistent control plane makes the CA and the service-account
    key once (tokens and kubeconfigs stay valid across restarts) and issues a leaf certificate
    again only when it is missing or expiring."""
    pki.mkdir(parents=True, exist_ok=True, mode=0o700)
    keep = persistent
    ca_days, leaf_days = (CA_DAYS, LEAF_DAYS) if keep else (30, 30)
    ca_name = _name("impvm-ca")
    if keep and (pki / "ca.crt").is_file() and (pki / "ca.key").is_file():
        ca_key = load_key(pki)
    else:
        ca_key = _key()
        ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True, days=ca_days)
        write_private(pki / "ca.key", _pem_key(ca_key))
        write_private(pki / "ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    if not (keep and (pki / "sa.key").is_file() and (pki / "sa.pub").is_file()):
        sa_key = _key()
        write_private(pki / "sa.key", _pem_key(sa_key))
        write_private(
            pki / "sa.pub",
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
    # etcd's own CA: only what it signs may talk to etcd (never a Kubernetes client cert)
    etcd_ca_name = _name("impvm-etcd-ca")
    if keep and (pki / "etcd-ca.crt").is_file() and (pki / "etcd-ca.key").is_file():
        etcd_ca_key = load_key(pki, "etcd-ca")
    else:
        etcd_ca_key = _key()
        etcd_ca = _cert(etcd_ca_name, etcd_ca_key, etcd_ca_name, etcd_ca_key, ca=True,
                        days=ca_days)  # fmt: skip
        write_private(pki / "etcd-ca.key", _pem_key(etcd_ca_key))
        write_private(pki / "etcd-ca.crt", etcd_ca.public_bytes(serialization.Encoding.PEM))
    leaves = {
        "apiserver": (_name("kube-apiserver"), {"server": True}, ca_name, ca_key),
        "admin": (_name("impvm-admin", "system:masters"), {"client": True}, ca_name, ca_key),
        # etcd's own gRPC gateway connects to it with this certificate: client use too
        "etcd-server": (_name("etcd"), {"server": True, "client": True}, etcd_ca_name,
                        etcd_ca_key),
        "etcd-peer": (_name("etcd-peer"), {"server": True, "client": True}, etcd_ca_name,
                      etcd_ca_key),
        "apiserver-etcd-client": (_name("kube-apiserver-etcd-client"), {"client": True},
                                  etcd_ca_name, etcd_ca_key),
    }  # fmt: skip
    if for_nodes:
        # the API server's identity to kubelets (logs, exec), bound to
        # system:kubelet-api-admin by the cluster
        leaves["apiserver-kubelet-client"] = (
            _name(KUBELET_CLIENT_USER, "kubeadm:cluster-admins"),
            {"client": True},
            ca_name,
            ca_key,
        )
    for stem, (subject, kind, issuer, issuer_key) in leaves.items():
        crt, key_path = pki / f"{stem}.crt", pki / f"{stem}.key"
        if keep and _fresh(crt, key_path):
            continue
        key = _key()
        cert = _cert(subject, key, issuer, issuer_key, days=leaf_days, addresses=(address,), **kind)
        write_private(key_path, _pem_key(key))
        write_private(crt, cert.public_bytes(serialization.Encoding.PEM))


def ensure_encryption(pki: Path, *, persistent: bool) -> tuple[Path, bool]:
    """The kube-apiserver ``EncryptionConfiguration`` for Secrets (made once when
    persistent: a new key would leave the Secrets already stored unreadable), and whether
    it was made now."""
    path = pki / "encryption.yaml"
    if persistent and path.is_file():
        return path, False
    key = base64.b64encode(os.urandom(32)).decode()
    config = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "EncryptionConfiguration",
        "resources": [
            {
                "resources": ["secrets"],
                "providers": [
                    {"secretbox": {"keys": [{"name": "key1", "secret": key}]}},
                    # reads Secrets stored before encryption was turned on
                    {"identity": {}},
                ],
            }
        ],
    }
    write_private(path, yaml.safe_dump(config).encode())
    return path, True
