"""What :class:`~impvm.up.service.Service` applies to its control plane: namespaces, the
components' RBAC (deploy/rbac), the admission policies (deploy/admission), the App credentials
and webhook secret from their files, and the configuration's classes, templates and pools (a
server-side dry run first, whose refusals are :class:`~impvm.up.config.ConfigError`); and the
pruning of what an earlier configuration applied."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import time
from typing import Any

from lightkube import AsyncClient
from lightkube.codecs import load_all_yaml
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import ValidatingAdmissionPolicy
from lightkube.resources.core_v1 import Namespace, Secret
from lightkube.types import PatchType

from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.up.config import APP_SECRET, WEBHOOK_SECRET, ConfigError, UpConfig
from impvm.up.manifests import COMPONENTS, MANAGED_BY, admission_manifests, rbac_manifest

#: seconds an object is retried while an admission policy is still being configured
POLICY_READY_SECONDS = 120.0
POLICY_REQUEUE_SECONDS = 5.0
REQUEUED_ANNOTATION = "imp.dev/requeued-at"


async def ensure_namespace(kube: AsyncClient, name: str) -> None:
    try:
        await kube.create(Namespace(metadata=ObjectMeta(name=name)))
    except ApiError as e:
        if e.status.code != 409:
            raise


async def apply_rbac(kube: AsyncClient) -> None:
    """The components' ServiceAccounts and roles (deploy/rbac)."""
    for component in COMPONENTS:
        for obj in load_all_yaml(rbac_manifest(component)):
            await kube.apply(obj, force=True)


async def apply_admission(kube: AsyncClient) -> None:
    """The admission policies (deploy/admission: what an agent may write, which namespaces
    may use each class), the API server's own checks, applied before any object of the
    configuration and before an agent starts."""
    for manifest in admission_manifests():
        for obj in load_all_yaml(manifest):
            await kube.apply(obj, force=True)


async def apply_secrets(kube: AsyncClient, config: UpConfig) -> None:
    """The App credentials (and webhook secret) from their files into Secrets of the
    pools' namespace, applied so a changed file updates them. The values are read here
    and sent to the API server only."""
    gh = config.github
    ns = config.kubernetes.namespace
    app = {
        "github_app_id": str(gh.app.id),
        "github_app_installation_id": str(gh.app.installation_id),
        "github_app_private_key": gh.app.private_key_file.read_text(),
    }
    await apply_secret(kube, APP_SECRET, ns, app)
    if gh.webhook_secret_file is not None:
        value = gh.webhook_secret_file.read_text().strip()
        await apply_secret(kube, WEBHOOK_SECRET, ns, {"webhook_secret": value})


async def apply_secret(kube: AsyncClient, name: str, namespace: str, data: dict[str, str]) -> None:
    secret = Secret(
        metadata=ObjectMeta(name=name, namespace=namespace, labels=dict(MANAGED_BY)),
        type="Opaque",
        data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    )
    await kube.apply(secret, force=True)


def config_objects(config: UpConfig) -> list[tuple[str, Any]]:
    """(config field, resource object) of every class, template and pool, in that order."""
    ns = config.kubernetes.namespace
    out: list[tuple[str, Any]] = []
    groups: list[tuple[str, str, Any, dict[str, Any], bool]] = [
        ("classes", "ImpVMClass", ImpVMClassResource, dict(config.classes), False),
        (
            "templates",
            "ImpVMTemplate",
            ImpVMTemplateResource,
            dict(config.templates),
            True,
        ),
        ("pools", "ImpVMRunnerPool", ImpVMRunnerPoolResource, dict(config.pools), True),
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


async def apply_objects(kube: AsyncClient, config: UpConfig, source: str, *, dry_run: bool) -> None:
    """Server-side apply the configuration's objects (``dry_run``: only ask the API server
    whether it would accept them; its CEL rules are the API's own). Raises
    :class:`ConfigError` naming the object (in ``source``) and the field the API server
    names."""
    for where, obj in config_objects(config):
        deadline = time.monotonic() + POLICY_READY_SECONDS
        requeued = 0.0
        while True:
            try:
                await kube.apply(obj, force=True, dry_run=dry_run)
                break
            except ApiError as e:
                if _policy_not_ready(e) and time.monotonic() < deadline:
                    # a started API server reads a policy's parameter kind (a CRD) a
                    # moment after it serves it: the object is not refused, only early
                    if time.monotonic() - requeued > POLICY_REQUEUE_SECONDS:
                        await requeue_policy(kube, e)
                        requeued = time.monotonic()
                    await asyncio.sleep(0.5)
                    continue
                if e.status.code not in (400, 422):
                    raise
                raise ConfigError(f"{source}: {where}: {_one_line(e)}") from None


async def requeue_policy(kube: AsyncClient, e: ApiError) -> None:
    """Touch the admission policy ``e`` names (an annotation) so the API server configures
    it again now. Its policy controller retries a policy whose CRD ``paramKind`` it did not
    find yet with exponential backoff and otherwise only when the policy changes; after an
    API server restart that backoff outlasts any wait (kubernetes/kubernetes issues
    122658 and 124237)."""
    name = _policy_name(e)
    if name is None:
        return
    patch = {"metadata": {"annotations": {REQUEUED_ANNOTATION: f"{time.time():.3f}"}}}
    with contextlib.suppress(ApiError):
        await kube.patch(ValidatingAdmissionPolicy, name, patch, patch_type=PatchType.MERGE)


async def prune(kube: AsyncClient, config: UpConfig) -> None:
    """Delete objects an earlier configuration applied that this one no longer holds."""
    ns = config.kubernetes.namespace
    keep: dict[Any, set[tuple[str | None, str]]] = {
        ImpVMRunnerPoolResource: {(ns, n) for n in config.pools},
        ImpVMTemplateResource: {(ns, n) for n in config.templates},
        ImpVMClassResource: {(None, n) for n in config.classes},
    }
    selector = dict(MANAGED_BY)
    for res, names in keep.items():
        kwargs: dict[str, Any] = {"labels": selector}
        if res is not ImpVMClassResource:
            kwargs["namespace"] = "*"
        async for obj in kube.list(res, **kwargs):
            meta = obj.metadata
            key = (meta.namespace, meta.name)
            if key not in names:
                await kube.delete(res, meta.name, namespace=meta.namespace)


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
