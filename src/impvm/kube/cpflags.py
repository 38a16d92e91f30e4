"""The command lines of the control plane's processes (etcd, kube-apiserver,
kube-controller-manager, and for real nodes kube-scheduler), from a
:class:`~impvm.kube.controlplane.ControlPlane`'s settings: what each listens on, the
certificates of :mod:`impvm.kube.pki` it presents and trusts, and, for a cluster with real
kubelets, kubeadm's authorization and admission (``Node,RBAC``, NodeRestriction)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impvm.kube.controlplane import ControlPlane

#: ClusterIPs of Services (the first, 10.0.0.1, is the API server's Service ``kubernetes``)
SERVICE_CIDR = "10.0.0.0/24"


def etcd(cp: ControlPlane, etcd_url: str, peer_url: str) -> list[str]:
    """etcd: client and peer URLs over TLS with client certificates of etcd's own CA."""
    assets, pki = cp.assets, cp.pki
    assert assets is not None
    return [
        str(assets / "etcd"),
        "--data-dir",
        str(cp.workdir / "etcd"),
        "--listen-client-urls",
        etcd_url,
        "--advertise-client-urls",
        etcd_url,
        "--cert-file",
        str(pki / "etcd-server.crt"),
        "--key-file",
        str(pki / "etcd-server.key"),
        "--trusted-ca-file",
        str(pki / "etcd-ca.crt"),
        "--client-cert-auth",
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"default={peer_url}",
        "--peer-cert-file",
        str(pki / "etcd-peer.crt"),
        "--peer-key-file",
        str(pki / "etcd-peer.key"),
        "--peer-trusted-ca-file",
        str(pki / "etcd-ca.crt"),
        "--peer-client-cert-auth",
        f"--unsafe-no-fsync={'false' if cp.etcd_fsync else 'true'}",
        "--log-level",
        "warn",
    ]


def apiserver(cp: ControlPlane, encryption: Path | None) -> list[str]:
    """kube-apiserver: etcd's client certificate, no anonymous access, client certificates of
    the cluster CA, service-account tokens signed by ``pki/sa.key``, Secrets encrypted with
    ``encryption`` (None: not)."""
    assets, pki = cp.assets, cp.pki
    assert assets is not None
    etcd_url = cp.etcd_url
    return [
        str(assets / "kube-apiserver"),
        "--etcd-servers",
        etcd_url,
        "--etcd-cafile",
        str(pki / "etcd-ca.crt"),
        "--etcd-certfile",
        str(pki / "apiserver-etcd-client.crt"),
        "--etcd-keyfile",
        str(pki / "apiserver-etcd-client.key"),
        "--anonymous-auth=false",
        "--bind-address",
        cp.bind_address,
        "--secure-port",
        str(cp.api_port),
        "--cert-dir",
        str(pki),
        "--tls-cert-file",
        str(pki / "apiserver.crt"),
        "--tls-private-key-file",
        str(pki / "apiserver.key"),
        "--client-ca-file",
        str(pki / "ca.crt"),
        *_apiserver_node_args(cp),
        "--service-cluster-ip-range",
        SERVICE_CIDR,
        "--allow-privileged=true",
        "--service-account-issuer",
        f"https://{cp.address}:{cp.api_port}/",
        "--service-account-key-file",
        str(pki / "sa.pub"),
        "--service-account-signing-key-file",
        str(pki / "sa.key"),
        *(["--encryption-provider-config", str(encryption)] if encryption else []),
        "--v",
        "1",
    ]


def controller_manager(cp: ControlPlane) -> list[str]:
    """kube-controller-manager (see :func:`_controller_manager_args`)."""
    assets = cp.assets
    assert assets is not None
    return [
        str(assets / "kube-controller-manager"),
        *_controller_manager_args(cp),
        "--leader-elect=false",
        "--secure-port",
        "0",
        "--concurrent-gc-syncs",
        "5",
        "--v",
        "1",
    ]


def scheduler(cp: ControlPlane) -> list[str]:
    """kube-scheduler of a cluster with real nodes, as ``system:kube-scheduler``."""
    assets = cp.assets
    assert assets is not None
    return [
        str(assets / "kube-scheduler"),
        "--kubeconfig",
        str(cp.client_kubeconfig(cp.workdir / "scheduler.kubeconfig", "system:kube-scheduler", [])),
        "--leader-elect=false",
        "--secure-port",
        "0",
        "--v",
        "1",
    ]


def _apiserver_node_args(cp: ControlPlane) -> list[str]:
    """Authorization and admission: envtest's (RBAC, no ServiceAccount admission) or, for
    real nodes, kubeadm's (``Node,RBAC``, NodeRestriction, kubelet client certificate)."""
    if not cp.for_nodes:
        return ["--authorization-mode", "RBAC", "--disable-admission-plugins", "ServiceAccount"]
    pki = cp.pki
    return [
        "--authorization-mode",
        "Node,RBAC",
        "--enable-admission-plugins",
        "NodeRestriction",
        "--advertise-address",
        cp.address,
        "--kubelet-client-certificate",
        str(pki / "apiserver-kubelet-client.crt"),
        "--kubelet-client-key",
        str(pki / "apiserver-kubelet-client.key"),
        "--kubelet-preferred-address-types",
        "InternalIP",
    ]


def _controller_manager_args(cp: ControlPlane) -> list[str]:
    """The garbage collector and namespace controllers as the admin, or (``for_nodes``)
    every default controller, each with its own ServiceAccount's credentials, signing
    ServiceAccount tokens and publishing the CA (``kube-root-ca.crt``, which every
    projected ServiceAccount volume reads)."""
    if not cp.for_nodes:
        return [
            "--kubeconfig",
            str(cp.kubeconfig),
            "--controllers",
            "garbagecollector,namespace",
        ]
    pki = cp.pki
    kubeconfig = cp.client_kubeconfig(
        cp.workdir / "controller-manager.kubeconfig", "system:kube-controller-manager", []
    )
    return [
        "--kubeconfig",
        str(kubeconfig),
        "--controllers",
        "*",
        "--use-service-account-credentials",
        "--service-account-private-key-file",
        str(pki / "sa.key"),
        "--root-ca-file",
        str(pki / "ca.crt"),
        "--cluster-signing-cert-file",
        str(pki / "ca.crt"),
        "--cluster-signing-key-file",
        str(pki / "ca.key"),
        "--service-cluster-ip-range",
        SERVICE_CIDR,
        "--allocate-node-cidrs=false",
        "--node-monitor-grace-period",
        "40s",
    ]
