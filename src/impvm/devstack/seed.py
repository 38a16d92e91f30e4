"""What the development stack and the tests seed GitHub and the cluster with: the App, its
installation on ``my-org``, the repository and the runner group of the GitHub stand-in; the
minimal example of the runner-pool docs; a pool's credentials Secret and pool manifests."""

from __future__ import annotations

import base64
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from impvm.devstack.standin import StandIn
from impvm.devstack.testimages import TestImages
from impvm.up.config import APP_SECRET

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
