"""Kubernetes helpers for the embedded stack and tests: clients, CRD installation, acting as a
ServiceAccount (TokenRequest, a real bearer token the API server authenticates)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Node, Pod, ServiceAccount, ServiceAccountToken

from impvm.api.crd import all_crds

FIELD_MANAGER = "impvm"


def admin_client(kubeconfig: Path) -> Client:
    """A synchronous client acting with the kubeconfig's (admin) credentials."""
    return Client(config=KubeConfig.from_file(str(kubeconfig)), field_manager=FIELD_MANAGER)


def install_crds(client: Client, timeout: float = 60.0) -> None:
    """Server-side apply every imp.dev CRD and wait until each is Established.

    Raises ``TimeoutError`` when a CRD is not established within ``timeout`` seconds.
    """
    for doc in all_crds():
        crd = cast(CustomResourceDefinition, CustomResourceDefinition.from_dict(doc))
        client.apply(crd, force=True)
    deadline = time.monotonic() + timeout
    for doc in all_crds():
        name = doc["metadata"]["name"]
        while True:
            got = client.get(CustomResourceDefinition, name)
            conds = (got.status.conditions if got.status else None) or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not established")
            time.sleep(0.1)
    # Established is not enough: the resource's storage initialises asynchronously and answers
    # 429 "storage is (re)initializing" until it is ready.
    from impvm.api.resources import (
        ImpVMClassResource,
        ImpVMResource,
        ImpVMRunnerPoolResource,
        ImpVMTemplateResource,
    )

    for res in (ImpVMClassResource, ImpVMTemplateResource, ImpVMRunnerPoolResource, ImpVMResource):
        while True:
            try:
                list(
                    client.list(res, namespace="*")
                    if res is not ImpVMClassResource
                    else client.list(res)
                )
                break
            except ApiError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def service_account_kubeconfig(
    client: Client, kubeconfig: Path, namespace: str, name: str, create: bool = True
) -> dict[str, Any]:
    """A kubeconfig (as a dict) authenticating as ServiceAccount ``namespace/name`` with a
    one-day token from the TokenRequest API. Creates the ServiceAccount when ``create``."""
    if create:
        try:
            client.create(ServiceAccount(metadata=ObjectMeta(name=name, namespace=namespace)))
        except ApiError as e:
            if e.status.code != 409:
                raise
    token = _token_request(client, namespace, name)
    admin = yaml.safe_load(kubeconfig.read_text())
    cluster = admin["clusters"][0]
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [
            {
                "name": "sa",
                "context": {"cluster": cluster["name"], "user": name, "namespace": namespace},
            }
        ],
        "current-context": "sa",
    }


def _token_request(client: Client, namespace: str, name: str) -> str:
    req = ServiceAccountToken(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=TokenRequestSpec(audiences=[], expirationSeconds=86400),
    )
    out = client.create(req, name=name, namespace=namespace)
    if out.status is None or not out.status.token:
        raise RuntimeError(f"TokenRequest for {namespace}/{name} returned no status")
    return out.status.token


def node_bound_token(
    client: Client,
    namespace: str,
    name: str,
    node: str,
    audience: str | None,
    seconds: int = 86400,
    labels: dict[str, str] | None = None,
) -> str:
    """A token of ServiceAccount ``namespace/name`` for ``audience`` (``None``: the API
    server's own audiences, a token to talk to it), valid ``seconds``, bound to the Node object
    ``node`` (created, with ``labels``, when missing): the API server then names the node in
    the user's extra ``authentication.kubernetes.io/node-name`` and stops honouring the token
    when the Node goes. What the kubelet's Pod-bound token is to a DaemonSet pod, for an agent
    running as a plain process. Raises ``ApiError``."""
    try:
        n = client.get(Node, node)
    except ApiError as e:
        if e.status.code != 404:
            raise
        try:
            n = client.create(Node(metadata=ObjectMeta(name=node, labels=labels)))
        except ApiError as e2:
            if e2.status.code != 409:
                raise
            n = client.get(Node, node)
    assert n.metadata is not None
    req = ServiceAccountToken(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=TokenRequestSpec(
            audiences=[audience] if audience is not None else [],
            expirationSeconds=seconds,
            boundObjectRef=BoundObjectReference(
                apiVersion="v1", kind="Node", name=node, uid=n.metadata.uid
            ),
        ),
    )
    out = client.create(req, name=name, namespace=namespace)
    if out.status is None or not out.status.token:
        raise RuntimeError(f"TokenRequest for {namespace}/{name} returned no status")
    return out.status.token


def pod_bound_token(
    client: Client,
    namespace: str,
    name: str,
    node: str,
    audience: str | None = None,
    seconds: int = 3600,
) -> str:
    """A token of ServiceAccount ``namespace/name`` bound to a Pod of that ServiceAccount on
    ``node`` (created here, named after it): what the kubelet projects into a DaemonSet pod, for
    tests of the chart's identities. The API server adds the pod's node to the user's extras
    (``authentication.kubernetes.io/node-name``) when the Node exists. ``audience``: None for
    the API server's own. Raises ``ApiError``."""
    pod = client.create(
        Pod(
            metadata=ObjectMeta(generateName=f"{name}-", namespace=namespace),
            spec=PodSpec(
                nodeName=node,
                serviceAccountName=name,
                containers=[Container(name="agent", image="registry.example/impvm-agent")],
            ),
        )
    )
    assert pod.metadata is not None and pod.metadata.name is not None
    ref = BoundObjectReference(
        apiVersion="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
    )
    req = ServiceAccountToken(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=TokenRequestSpec(
            audiences=[audience] if audience is not None else [],
            expirationSeconds=seconds,
            boundObjectRef=ref,
        ),
    )
    out = client.create(req, name=name, namespace=namespace)
    if out.status is None or not out.status.token:
        raise RuntimeError(f"TokenRequest for {namespace}/{name} returned no status")
    return out.status.token


def client_from_dict(config: dict[str, Any], namespace: str | None = None) -> Client:
    """A synchronous client from a kubeconfig dict (e.g. :func:`service_account_kubeconfig`)."""
    return Client(config=KubeConfig.from_dict(config), namespace=namespace)
