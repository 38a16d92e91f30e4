"""Secrets are encrypted in etcd's files (the App's private key and the JIT configs of an
``impvm up`` machine live there); other objects are not, which shows the search finds what is
stored in clear."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from lightkube import Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Secret

from impvm.kube.controlplane import ControlPlane


def _etcd_holds(control_plane: ControlPlane, needle: bytes) -> bool:
    return any(
        needle in p.read_bytes()
        for p in (control_plane.workdir / "etcd").rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    )


def _wait_for(pred: object, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_secrets_are_encrypted_in_etcd_files(
    control_plane: ControlPlane, kube: Client, namespace: str
) -> None:
    plain = f"impvm-clear-{secrets.token_hex(12)}"
    hidden = f"impvm-secret-{secrets.token_hex(12)}"
    kube.create(
        ConfigMap(metadata=ObjectMeta(name="plain", namespace=namespace), data={"v": plain})
    )
    kube.create(
        Secret(metadata=ObjectMeta(name="hidden", namespace=namespace), stringData={"v": hidden})
    )
    # the ConfigMap reaches etcd's files in clear: the search sees what is stored
    assert _wait_for(lambda: _etcd_holds(control_plane, plain.encode()))
    got = kube.get(Secret, "hidden", namespace=namespace)
    assert got.data is not None and "v" in got.data  # readable through the API
    assert not _etcd_holds(control_plane, hidden.encode())
    config = Path(control_plane.pki / "encryption.yaml")
    assert config.stat().st_mode & 0o077 == 0


def _stored(cp: ControlPlane, key: str) -> bytes:
    """The value etcd holds now for ``key`` (etcd's JSON gateway to its KV API, with the client
    certificate etcd requires)."""
    import base64
    import json
    import urllib.request

    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(f"{cp.etcd_url}/v3/kv/range", data=body)
    with urllib.request.urlopen(req, timeout=10, context=cp.etcd_tls()) as r:
        kvs = json.loads(r.read()).get("kvs") or []
    return base64.b64decode(kvs[0]["value"]) if kvs else b""


def test_secrets_stored_before_encryption_are_encrypted_at_the_next_start(
    tmp_path: Path,
) -> None:
    from impvm.kube.admin import admin_client

    hidden = f"impvm-secret-{secrets.token_hex(12)}"
    old = ControlPlane(workdir=tmp_path / "cp", persistent=True, encrypt_secrets=False).start()
    try:
        kube = admin_client(old.kubeconfig)
        kube.create(
            Secret(metadata=ObjectMeta(name="old", namespace="default"), stringData={"v": hidden})
        )
        assert hidden.encode() in _stored(old, "/registry/secrets/default/old")
    finally:
        old.stop()
    cp = ControlPlane(workdir=tmp_path / "cp", persistent=True).start()
    try:
        stored = _stored(cp, "/registry/secrets/default/old")
        assert stored.startswith(b"k8s:enc:secretbox:v1:key1:") and hidden.encode() not in stored
        got = admin_client(cp.kubeconfig).get(Secret, "old", namespace="default")
        assert got.data is not None and "v" in got.data
    finally:
        cp.stop()
