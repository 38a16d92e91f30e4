"""A class says which namespaces may use it (``spec.namespaces``), and the real API server
enforces it with the ValidatingAdmissionPolicy of deploy/admission (as applied by ``impvm up``,
the dev stack and the chart): an ImpVMTemplate or ImpVM naming a class its namespace may not
use is refused at create, and when an existing one changes to such a class, with a message
naming the class and the namespace; an object that keeps its class is never refused (so a class
narrowed later does not strand VMs being deleted). The API server's verdict equals the model's
``ClassNamespaces.admits`` for any selector (a property test)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightkube import ApiError, Client
from lightkube.codecs import load_all_yaml
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType

from impvm.api.resources import ImpVMClassResource, ImpVMResource, ImpVMTemplateResource

pytestmark = [pytest.mark.controlplane]

REPO = Path(__file__).resolve().parent.parent
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
IMAGE = "registry.example/imp/runner-base@sha256:" + "1" * 64


def apply_policies(kube: Client) -> None:
    """deploy/admission, created once per control plane (``kubectl apply`` semantics)."""
    for path in sorted((REPO / "deploy" / "admission").glob("*.yaml")):
        for obj in load_all_yaml(path.read_text()):
            try:
                kube.create(obj)
            except ApiError as e:
                if e.status.code != 409:
                    raise


def caught_up(kube: Client, namespace: str) -> None:
    """Wait until the API server's policy has seen every class change made so far: it reads
    classes from a watch, so a change takes a moment to count. A probe class created now (it
    admits no namespace) is refused as soon as the policy has seen it, and with it every change
    before it (a watch delivers in order)."""
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    kube.create(klass(probe, {"from": "Selector", "selector": {"matchLabels": {"impvm": "none"}}}))
    try:
        for _ in range(200):
            try:
                kube.create(template(namespace, probe, probe), dry_run=True)
            except ApiError as e:
                if e.status.code in (403, 422):
                    return
                raise
            time.sleep(0.05)
        # no policy refuses anything: what follows says what that means
    finally:
        kube.delete(ImpVMClassResource, probe)


def klass(name: str, namespaces: dict[str, Any] | None = None) -> Any:
    spec: dict[str, Any] = {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1}
    if namespaces is not None:
        spec["namespaces"] = namespaces
    return ImpVMClassResource.from_dict(
        {"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass", "metadata": {"name": name}}
        | {"spec": spec}
    )


def template(ns: str, name: str, cls: str) -> Any:
    return ImpVMTemplateResource.from_dict(
        {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVMTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"classRef": {"name": cls}, "image": IMAGE},
        }
    )


def vm(ns: str, name: str, cls: str) -> Any:
    return ImpVMResource.from_dict(
        {
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVM",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"classRef": {"name": cls}, "image": IMAGE},
        }
    )


def refused(call: Any) -> str:
    """The API server's message refusing ``call()`` (fails if it was accepted)."""
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status.code in (403, 422), e.value.status
    return str(e.value.status.message)


@pytest.fixture
def world(kube: Client) -> Iterator[tuple[str, str, str, str]]:
    """Namespaces ``team`` (label team=red) and ``other``; classes ``open`` (no restriction)
    and ``internal`` (only namespaces labelled team=red)."""
    apply_policies(kube)
    tag = uuid.uuid4().hex[:6]
    team, other = f"team-{tag}", f"other-{tag}"
    kube.create(Namespace(metadata=ObjectMeta(name=team, labels={"team": "red"})))
    kube.create(Namespace(metadata=ObjectMeta(name=other)))
    open_, internal = f"open-{tag}", f"internal-{tag}"
    kube.create(klass(open_))
    kube.create(klass(internal, {"from": "Selector", "selector": {"matchLabels": {"team": "red"}}}))
    caught_up(kube, other)
    yield team, other, open_, internal
    for c in (open_, internal):
        kube.delete(ImpVMClassResource, c)
    for n in (team, other):
        kube.delete(Namespace, n)


def test_a_restricted_class_is_refused_outside_its_namespaces(
    kube: Client, world: tuple[str, str, str, str]
) -> None:
    team, other, open_, internal = world
    kube.create(template(team, "t", internal))  # selected: allowed
    kube.create(vm(team, "v", internal))
    kube.create(template(other, "t", open_))  # a class without spec.namespaces: everywhere
    msg = refused(lambda: kube.create(template(other, "t2", internal)))
    assert internal in msg and other in msg and "spec.namespaces" in msg
    refused(lambda: kube.create(vm(other, "v", internal)))
    # moving an existing template onto the class is refused too
    refused(
        lambda: kube.patch(
            ImpVMTemplateResource,
            "t",
            {"spec": {"classRef": {"name": internal}}},
            namespace=other,
            patch_type=PatchType.MERGE,
        )
    )


def test_a_class_narrowed_later_refuses_new_objects_and_strands_none(
    kube: Client, world: tuple[str, str, str, str]
) -> None:
    _, other, open_, _ = world
    kube.create(template(other, "t", open_))
    kube.create(vm(other, "v", open_))
    narrowed = {"from": "Selector", "selector": {"matchLabels": {"team": "red"}}}
    kube.patch(
        ImpVMClassResource,
        open_,
        {"spec": {"namespaces": narrowed}},
        patch_type=PatchType.MERGE,
    )
    caught_up(kube, other)
    refused(lambda: kube.create(vm(other, "v2", open_)))
    # objects that keep their class still change (an agent releasing its finalizer, a new
    # image rolled out): never refused
    kube.patch(
        ImpVMResource,
        "v",
        {"metadata": {"finalizers": ["imp.dev/agent"]}},
        namespace=other,
        patch_type=PatchType.MERGE,
    )
    kube.patch(
        ImpVMResource,
        "v",
        {"metadata": {"finalizers": None}},
        namespace=other,
        patch_type=PatchType.MERGE,
    )
    kube.patch(
        ImpVMTemplateResource,
        "t",
        {"spec": {"image": IMAGE.replace("1" * 64, "2" * 64)}},
        namespace=other,
        patch_type=PatchType.MERGE,
    )
    kube.delete(ImpVMResource, "v", namespace=other)


def test_a_namespace_is_selected_by_its_name(
    kube: Client, world: tuple[str, str, str, str]
) -> None:
    team, other, _, _ = world
    by_name = f"by-name-{uuid.uuid4().hex[:6]}"
    rule = {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": [other]}
    kube.create(klass(by_name, {"from": "Selector", "selector": {"matchExpressions": [rule]}}))
    caught_up(kube, team)
    try:
        kube.create(template(other, "named", by_name))
        refused(lambda: kube.create(template(team, "named", by_name)))
    finally:
        kube.delete(ImpVMClassResource, by_name)


def test_the_api_refuses_a_selector_without_from_selector(kube: Client) -> None:
    name = f"bad-{uuid.uuid4().hex[:6]}"
    msg = refused(lambda: kube.create(klass(name, {"from": "Selector"})))
    assert "namespaces.selector" in msg
    msg = refused(
        lambda: kube.create(
            klass(name, {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}})
        )
    )
    assert "namespaces.selector" in msg or "values" in msg


# ------------------------------------------------------------------------------- the property

NS_LABELS = [{"team": "red"}, {"team": "blue", "tier": "prod"}, {"tier": "dev"}, {}]
KEYS = st.sampled_from(["team", "tier", NAMESPACE_NAME_LABEL])
VALUES = st.lists(st.sampled_from(["red", "blue", "prod", "dev", "x"]), min_size=1, max_size=3)
REQUIREMENT = st.one_of(
    st.builds(
        lambda k, op, v: {"key": k, "operator": op, "values": v},
        KEYS,
        st.sampled_from(["In", "NotIn"]),
        VALUES,
    ),
    st.builds(
        lambda k, op: {"key": k, "operator": op}, KEYS, st.sampled_from(["Exists", "DoesNotExist"])
    ),
)
SELECTOR = st.fixed_dictionaries(
    {},
    optional={
        "matchLabels": st.dictionaries(
            st.sampled_from(["team", "tier"]), VALUES.map(lambda v: v[0]), max_size=2
        ),
        "matchExpressions": st.lists(REQUIREMENT, max_size=3),
    },
)


@pytest.fixture(scope="module")
def labelled(kube: Client) -> Iterator[list[tuple[str, dict[str, str]]]]:
    apply_policies(kube)
    tag = uuid.uuid4().hex[:6]
    out = []
    for i, labels in enumerate(NS_LABELS):
        name = f"prop-{i}-{tag}"
        kube.create(Namespace(metadata=ObjectMeta(name=name, labels=labels)))
        out.append((name, labels | {NAMESPACE_NAME_LABEL: name}))
    yield out
    for name, _ in out:
        kube.delete(Namespace, name)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(selector=SELECTOR)
def test_prop_the_api_servers_verdict_is_the_models(
    kube: Client, labelled: list[tuple[str, dict[str, str]]], selector: dict[str, Any]
) -> None:
    from impvm.api.models import ClassNamespaces

    rule = {"from": "Selector", "selector": selector}
    model = ClassNamespaces.model_validate(rule)
    name = f"prop-{uuid.uuid4().hex[:8]}"
    kube.create(klass(name, rule))
    caught_up(kube, labelled[0][0])
    try:
        for ns, labels in labelled:
            try:
                kube.create(template(ns, name, name), dry_run=True)
                admitted = True
            except ApiError as e:
                assert e.status.code in (403, 422), e.status
                admitted = False
            assert admitted == model.admits(labels), (ns, labels, selector)
    finally:
        kube.delete(ImpVMClassResource, name)
