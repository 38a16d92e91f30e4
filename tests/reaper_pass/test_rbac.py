"""Least privilege, on the real API server: deploy/rbac/reaper.yaml
gives the reaper's ServiceAccount exactly what a pass needs in its namespace, a pass runs as
that ServiceAccount, and the ServiceAccount can do nothing else."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient, Client
from lightkube.codecs import load_all_yaml
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authorization_v1 import (
    ResourceAttributes,
    SelfSubjectAccessReviewSpec,
    SubjectAccessReviewSpec,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview, SubjectAccessReview
from lightkube.resources.core_v1 import Namespace, Secret
from lightkube.types import PatchType

from impvm.api.models import ImpVMRunnerPool
from impvm.api.resources import ImpVMResource, ImpVMRunnerPoolResource
from impvm.kube.admin import client_from_dict, service_account_kubeconfig
from impvm.kube.controlplane import ControlPlane
from impvm.operator.credentials import GitHubProvider
from impvm.operator.reaper import reap_pool

from .conftest import SECRET, TOKEN_PATH, World, four_vms, now

pytestmark = [pytest.mark.controlplane]

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "rbac" / "reaper.yaml"
SA = "impvm-reaper"

# (verb, group, resource, subresource, name): what one pass needs
NEEDED = [
    ("list", "imp.dev", "impvms", "", ""),
    ("watch", "imp.dev", "impvms", "", ""),
    ("get", "imp.dev", "impvms", "", ""),
    ("delete", "imp.dev", "impvms", "", ""),
    ("get", "imp.dev", "impvmrunnerpools", "", ""),
    ("list", "imp.dev", "impvmrunnerpools", "", ""),
    ("patch", "imp.dev", "impvmrunnerpools", "status", ""),
    ("get", "", "secrets", "", SECRET),
    ("create", "", "events", "", ""),
    ("create", "events.k8s.io", "events", "", ""),
]
# what it must not do in its own namespace
FORBIDDEN = [
    ("create", "imp.dev", "impvms", "", ""),
    ("update", "imp.dev", "impvms", "", ""),
    ("patch", "imp.dev", "impvms", "", ""),
    ("patch", "imp.dev", "impvms", "status", ""),
    ("update", "imp.dev", "impvms", "status", ""),
    ("deletecollection", "imp.dev", "impvms", "", ""),
    ("create", "imp.dev", "impvmrunnerpools", "", ""),
    ("update", "imp.dev", "impvmrunnerpools", "", ""),
    ("patch", "imp.dev", "impvmrunnerpools", "", ""),
    ("delete", "imp.dev", "impvmrunnerpools", "", ""),
    ("update", "imp.dev", "impvmrunnerpools", "status", ""),
    ("get", "imp.dev", "impvmtemplates", "", ""),
    ("list", "imp.dev", "impvmclasses", "", ""),
    ("get", "", "secrets", "", "another-secret"),
    ("list", "", "secrets", "", ""),
    ("watch", "", "secrets", "", ""),
    ("update", "", "secrets", "", SECRET),
    ("patch", "", "secrets", "", SECRET),
    ("delete", "", "secrets", "", SECRET),
    ("create", "", "secrets", "", ""),
    ("get", "", "events", "", ""),
    ("delete", "", "events", "", ""),
    ("create", "", "pods", "", ""),
    ("create", "", "serviceaccounts", "token", SA),
    ("create", "rbac.authorization.k8s.io", "rolebindings", "", ""),
    ("escalate", "rbac.authorization.k8s.io", "roles", "", ""),
    ("bind", "rbac.authorization.k8s.io", "roles", "", ""),
]


def apply_manifest(kube: Client, namespace: str, secret: str = SECRET) -> None:
    """Create deploy/rbac/reaper.yaml in ``namespace`` with the App Secret name substituted
    (what `kubectl apply -n` does with the documented substitution)."""
    docs: list[dict[str, Any]] = list(yaml.safe_load_all(MANIFEST.read_text()))
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        for rule in doc.get("rules", []):
            if "resourceNames" in rule:
                rule["resourceNames"] = [secret]
    for obj in load_all_yaml(yaml.safe_dump_all(docs)):
        kube.create(obj)


def attrs(namespace: str, verb: str, group: str, resource: str, sub: str, name: str) -> Any:
    return ResourceAttributes(
        namespace=namespace,
        verb=verb,
        group=group,
        resource=resource,
        subresource=sub or None,
        name=name or None,
    )


def self_review(client: Client, namespace: str, check: tuple[str, ...]) -> bool:
    review = SelfSubjectAccessReview(
        spec=SelfSubjectAccessReviewSpec(resourceAttributes=attrs(namespace, *check))
    )
    out = client.create(review)
    assert out.status is not None
    return bool(out.status.allowed)


@pytest.fixture
def other_namespace(kube: Client) -> Any:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    kube.delete(Namespace, name)


@pytest.fixture
def sa_config(world: World, control_plane: ControlPlane) -> dict[str, Any]:
    apply_manifest(world.kube, world.namespace)
    return service_account_kubeconfig(
        world.kube, control_plane.kubeconfig, world.namespace, SA, create=False
    )


@pytest.fixture
async def sa_kube(sa_config: dict[str, Any]) -> AsyncIterator[AsyncClient]:
    client = AsyncClient(config=KubeConfig.from_dict(sa_config), field_manager="impvm-reaper")
    yield client
    await client.close()


def test_service_account_may_do_only_what_a_pass_needs(
    world: World, sa_config: dict[str, Any], other_namespace: str
) -> None:
    sa = client_from_dict(sa_config)
    ns = world.namespace
    for check in NEEDED:
        assert self_review(sa, ns, check), f"needed but denied: {check}"
    for check in FORBIDDEN:
        assert not self_review(sa, ns, check), f"allowed but not needed: {check}"
    # nothing at all in another namespace, nothing cluster-wide
    for check in NEEDED:
        assert not self_review(sa, other_namespace, check), f"allowed elsewhere: {check}"
        assert not self_review(sa, "", check), f"allowed cluster-wide: {check}"

    # the same answers from the admin's point of view (SubjectAccessReview of the SA user)
    user = f"system:serviceaccount:{ns}:{SA}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]

    def review(namespace: str, check: tuple[str, ...]) -> bool:
        spec = SubjectAccessReviewSpec(
            user=user, groups=groups, resourceAttributes=attrs(namespace, *check)
        )
        out = world.kube.create(SubjectAccessReview(spec=spec))
        assert out.status is not None
        return bool(out.status.allowed)

    assert review(ns, ("delete", "imp.dev", "impvms", "", ""))
    assert not review(ns, ("patch", "imp.dev", "impvms", "", ""))
    assert not review(other_namespace, ("delete", "imp.dev", "impvms", "", ""))
    assert not review(ns, ("get", "", "secrets", "", "another-secret"))


async def test_a_pass_runs_as_the_service_account(
    world: World, sa_kube: AsyncClient, sa_config: dict[str, Any]
) -> None:
    """The Role is sufficient: a full pass (read the App Secret, list, delete, write the
    condition, record Events) as the ServiceAccount; and real requests beyond it are refused."""
    world.create_pool()
    four_vms(world)
    pool = (await sa_kube.get(ImpVMRunnerPoolResource, world.pool_name)).to_dict()
    provider = GitHubProvider(sa_kube, api_url=world.standin.url)
    platform = ImpVMRunnerPool.model_validate(pool).spec.platform
    try:
        github = await provider.client(world.namespace, platform)
        report = await reap_pool(sa_kube, github, pool, now())
    finally:
        await provider.close()

    v = world.vms
    assert report.complete
    assert sorted(o.vm for o in report.deleted) == sorted([v["hung"], v["cancelled"]])
    assert world.vm_names() == {v["idle"], v["busy"]}
    assert len(world.events("RunnerReaped")) == 2
    cond = world.condition()
    assert cond is not None and cond["status"] == "True"
    assert [r["permissions"] for r in world.requests(TOKEN_PATH)] == [{"actions": "read"}]

    # real requests outside the Role are refused by the API server (403)
    sa = client_from_dict(sa_config)
    world.kube.create(
        Secret(
            metadata=ObjectMeta(name="another-secret", namespace=world.namespace),
            stringData={"x": "y"},
        )
    )
    refused = [
        lambda: sa.patch(
            ImpVMResource,
            v["idle"],
            {"metadata": {"labels": {"x": "y"}}},
            patch_type=PatchType.MERGE,
        ),
        lambda: sa.patch(
            ImpVMRunnerPoolResource,
            world.pool_name,
            {"metadata": {"labels": {"x": "y"}}},
            patch_type=PatchType.MERGE,
        ),
        lambda: sa.get(Secret, "another-secret"),
        lambda: list(sa.list(Secret)),
        lambda: list(sa.list(ImpVMResource, namespace="default")),
        lambda: sa.delete(ImpVMRunnerPoolResource, world.pool_name),
    ]
    for attempt in refused:
        with pytest.raises(ApiError) as exc:
            attempt()
        assert exc.value.status.code == 403
    assert world.vm_names() == {v["idle"], v["busy"]}
