"""The imp.dev/v1alpha1 API on a real kube-apiserver: the seed's example applies verbatim, and each
invalid variant is rejected by the server with a message naming the field (issue: foundation)."""

from __future__ import annotations

import copy
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from lightkube import Client
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from impvm.api.models import ImpVMRunnerPool
from impvm.api.resources import (
    ImpVMClassResource,
    ImpVMResource,
    ImpVMRunnerPoolResource,
    ImpVMTemplateResource,
)
from impvm.devstack.seed import example_scaling, pool_manifest
from impvm.kube.controlplane import ControlPlane
from impvm.scaling.warmpool import WarmPoolPolicy, WarmPoolState
from tests.conftest import REPO

DIGEST_A = "registry.example/imp/runner-base@sha256:" + "a" * 64
DIGEST_B = "registry.example/imp/runner-layer@sha256:" + "b" * 64

SEED_EXAMPLE = REPO / "tests" / "data" / "minimal-example.yaml"


def kubectl(
    cp: ControlPlane, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cp.kubectl), "--kubeconfig", str(cp.kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def base_pool(namespace: str, name: str = "p") -> dict[str, Any]:
    return pool_manifest(name, namespace, example_scaling())


def rejected(kube: Client, resource: Any, obj: dict[str, Any]) -> str:
    """Create ``obj``; assert the API server refuses it (422) and return its message."""
    with pytest.raises(ApiError) as info:
        kube.create(resource.from_dict(obj))
    assert info.value.status.code == 422, info.value.status
    return str(info.value.status.message)


@pytest.mark.controlplane
def test_seed_minimal_example_applies_verbatim(control_plane: ControlPlane, kube: Client) -> None:
    out = kubectl(control_plane, "apply", "-f", str(SEED_EXAMPLE))
    assert out.returncode == 0, out.stderr
    got = kube.get(ImpVMRunnerPoolResource, "ci-pool", namespace="default")
    pool = ImpVMRunnerPool.model_validate(got.to_dict())
    assert pool.spec.platform.scope.org == "my-org"
    assert pool.spec.labels == ["imp"]
    assert pool.spec.scaling is not None and pool.spec.scaling.max_concurrent == 5
    # defaults applied by the server from the schema
    assert pool.spec.bootstrap_timeout_seconds == 300
    kube.get(ImpVMClassResource, "runner-class")  # cluster-scoped
    kube.get(ImpVMTemplateResource, "gh-runner", namespace="default")

    table = kubectl(control_plane, "get", "imprp", "-n", "default")
    assert table.returncode == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header == ["NAME", "PLATFORM", "TEMPLATE", "IDLE", "BUSY", "DESIRED", "READY", "AGE"]
    assert "ci-pool" in table.stdout and "github-actions" in table.stdout
    cat = kubectl(control_plane, "get", "imp", "-n", "default", "-o", "name")
    assert "impvmrunnerpool.imp.dev/ci-pool" in cat.stdout, cat.stdout + cat.stderr


@pytest.mark.controlplane
def test_vm_printer_columns(control_plane: ControlPlane, kube: Client, namespace: str) -> None:
    kube.create(
        ImpVMResource.from_dict(
            {
                "metadata": {"name": "vm-1", "namespace": namespace},
                "spec": {"classRef": {"name": "c"}, "image": DIGEST_A, "nodeName": "node-a"},
            }
        )
    )
    table = kubectl(control_plane, "get", "impvm", "-n", namespace)
    assert table.stdout.splitlines()[0].split() == ["NAME", "PHASE", "NODE", "RUNNER", "AGE"]
    assert "node-a" in table.stdout


def _mutate(pool: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(pool)
    node = out
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return out


_DELETE = object()

# (case id, path to change, new value, words the server's message must contain)
POOL_CASES: list[tuple[str, str, Any, list[str]]] = [
    (
        "scope-both",
        "spec.platform.scope",
        {"org": "o", "repo": "o/r"},
        ["platform.scope", "exactly one"],
    ),
    ("scope-empty", "spec.platform.scope", {}, ["platform.scope", "exactly one"]),
    ("scope-missing", "spec.platform.scope", _DELETE, ["spec.platform.scope", "Required"]),
    ("scaling-missing", "spec.scaling", _DELETE, ["scaling is required"]),
    ("minIdle-missing", "spec.scaling.minIdle", _DELETE, ["scaling.minIdle is required"]),
    (
        "maxConcurrent-missing",
        "spec.scaling.maxConcurrent",
        _DELETE,
        ["scaling.maxConcurrent is required"],
    ),
    (
        "scaleUpStep-missing",
        "spec.scaling.scaleUpStep",
        _DELETE,
        ["scaling.scaleUpStep is required"],
    ),
    (
        "cooldown-missing",
        "spec.scaling.cooldownSeconds",
        _DELETE,
        ["scaling.cooldownSeconds is required"],
    ),
    ("minIdle-gt-max", "spec.scaling.minIdle", 6, ["scaling.minIdle", "maxConcurrent"]),
    ("polling-missing", "spec.scaling.polling", _DELETE, ["scaling.polling is required"]),
    (
        "tokenSource-bad",
        "spec.platform.tokenSource",
        "oauth",
        ["spec.platform.tokenSource", "Unsupported value"],
    ),
    ("labels-empty-item", "spec.labels", ["imp", ""], ["spec.labels[1]"]),
    ("labels-too-many", "spec.labels", [f"l{i}" for i in range(101)], ["spec.labels", "101"]),
    ("expireAfter-short", "spec.expireAfter", "30s", ["expireAfter", "60s"]),
    ("runnerLayer-tag", "spec.runnerLayer", "ghcr.io/x/runner:latest", ["runnerLayer", "digest"]),
    ("scaleUpStep-zero", "spec.scaling.scaleUpStep", 0, ["spec.scaling.scaleUpStep"]),
    ("label-comma", "spec.labels", ["a,b"], ["spec.labels[0]"]),
    ("label-space", "spec.labels", [" "], ["spec.labels[0]"]),
    ("label-newline", "spec.labels", ["x\ny"], ["spec.labels[0]"]),
    ("label-duplicate", "spec.labels", ["imp", "imp"], ["spec.labels[1]", "Duplicate"]),
    ("repo-dotdot", "spec.platform.scope", {"repo": "my-org/.."}, ["scope.repo"]),
    ("templateName-bad", "spec.templateName", "Not_A_Name", ["spec.templateName"]),
    (
        "credentialsSecret-bad",
        "spec.platform.credentialsSecret",
        "../etc",
        ["spec.platform.credentialsSecret"],
    ),
    (
        "serverURL-http",
        "spec.platform.serverURL",
        "http://ghe.example.com",
        ["spec.platform.serverURL"],
    ),
    ("polling-disabled", "spec.scaling.polling", {"enabled": False}, ["scaling.polling.enabled"]),
    (
        "reaper-interval-huge",
        "spec.reaper",
        {"enabled": True, "intervalSeconds": 2**62},
        ["spec.reaper.intervalSeconds"],
    ),
    ("minIdle-negative", "spec.scaling.minIdle", -1, ["spec.scaling.minIdle"]),
    # warm pool
    (
        "warmPool-mode-bad",
        "spec.scaling.warmPool",
        {"mode": "magic"},
        ["spec.scaling.warmPool.mode", "Unsupported value"],
    ),
    (
        "warmPool-adaptive-without-maxIdle",
        "spec.scaling.warmPool",
        {"mode": "adaptive"},
        ["scaling.warmPool.maxIdle is required when scaling.warmPool.mode is adaptive"],
    ),
    (
        "warmPool-fixed-with-safety",
        "spec.scaling.warmPool",
        {"safetyPercent": 150},
        ["scaling.warmPool.safetyPercent is only used when scaling.warmPool.mode is adaptive"],
    ),
    (
        "warmPool-fixed-with-half-life",
        "spec.scaling.warmPool",
        {"mode": "fixed", "arrivalHalfLifeSeconds": 60},
        ["scaling.warmPool.arrivalHalfLifeSeconds is only used"],
    ),
    (
        "warmPool-maxIdle-below-minIdle",
        "spec.scaling.warmPool",
        {"mode": "adaptive", "maxIdle": 0},
        ["spec.scaling.warmPool.maxIdle", "greater than or equal to scaling.minIdle"],
    ),
    (
        "warmPool-maxIdle-above-maxConcurrent",
        "spec.scaling.warmPool",
        {"mode": "adaptive", "maxIdle": 6},
        ["spec.scaling.warmPool.maxIdle", "less than or equal to scaling.maxConcurrent"],
    ),
    (
        "warmPool-safety-below-100",
        "spec.scaling.warmPool",
        {"mode": "adaptive", "maxIdle": 3, "safetyPercent": 50},
        ["spec.scaling.warmPool.safetyPercent"],
    ),
    (
        "warmPool-half-life-zero",
        "spec.scaling.warmPool",
        {"mode": "adaptive", "maxIdle": 3, "readyHalfLifeSamples": 0},
        ["spec.scaling.warmPool.readyHalfLifeSamples"],
    ),
    (
        "schedule-minute-61",
        "spec.scaling.warmPool",
        {"schedules": [{"name": "a", "start": "61 * * * *", "end": "0 8 * * *", "minIdle": 1}]},
        ["spec.scaling.warmPool.schedules[0].start"],
    ),
    (
        "schedule-six-fields",
        "spec.scaling.warmPool",
        {"schedules": [{"name": "a", "start": "0 7 * * *", "end": "0 0 8 * * *", "minIdle": 1}]},
        ["spec.scaling.warmPool.schedules[0].end"],
    ),
    (
        "schedule-empty-window",
        "spec.scaling.warmPool",
        {"schedules": [{"name": "a", "start": "0 8 * * *", "end": "0 8 * * *", "minIdle": 1}]},
        ["spec.scaling.warmPool.schedules[0].end", "must differ from start"],
    ),
    (
        "schedule-minIdle-above-maxConcurrent",
        "spec.scaling.warmPool",
        {"schedules": [{"name": "a", "start": "0 8 * * *", "end": "0 9 * * *", "minIdle": 6}]},
        [
            "scaling.warmPool.schedules[].minIdle must be less than or equal to scaling.maxConcurrent"
        ],
    ),
    (
        "schedule-duplicate-name",
        "spec.scaling.warmPool",
        {
            "schedules": [
                {"name": "a", "start": "0 8 * * *", "end": "0 9 * * *", "minIdle": 1},
                {"name": "a", "start": "0 10 * * *", "end": "0 11 * * *", "minIdle": 1},
            ]
        },
        ["spec.scaling.warmPool.schedules[1]", "Duplicate value"],
    ),
    (
        "schedule-time-zone-path",
        "spec.scaling.warmPool",
        {
            "schedules": [
                {
                    "name": "a",
                    "start": "0 8 * * *",
                    "end": "0 9 * * *",
                    "minIdle": 1,
                    "timeZone": "../../etc/passwd",
                }
            ]
        },
        ["spec.scaling.warmPool.schedules[0].timeZone"],
    ),
    (
        "schedule-name-bad",
        "spec.scaling.warmPool",
        {
            "schedules": [
                {"name": "Work Hours", "start": "0 8 * * *", "end": "0 9 * * *", "minIdle": 1}
            ]
        },
        ["spec.scaling.warmPool.schedules[0].name"],
    ),
    (
        "schedule-minIdle-missing",
        "spec.scaling.warmPool",
        {"schedules": [{"name": "a", "start": "0 8 * * *", "end": "0 9 * * *"}]},
        ["spec.scaling.warmPool.schedules[0].minIdle", "Required"],
    ),
]


@pytest.mark.controlplane
@pytest.mark.parametrize(
    ("case", "path", "value", "words"), POOL_CASES, ids=[c[0] for c in POOL_CASES]
)
def test_invalid_pool_rejected_naming_field(
    kube: Client, namespace: str, case: str, path: str, value: Any, words: list[str]
) -> None:
    msg = rejected(kube, ImpVMRunnerPoolResource, _mutate(base_pool(namespace), path, value))
    for w in words:
        assert w in msg, f"{case}: {w!r} not in server message {msg!r}"


@pytest.mark.controlplane
def test_webhook_mode_requires_secret_ref(kube: Client, namespace: str) -> None:
    for mode in ("webhook", "hybrid"):
        pool = _mutate(base_pool(namespace), "spec.scaling.mode", mode)
        msg = rejected(kube, ImpVMRunnerPoolResource, pool)
        assert "scaling.webhook.secretRef is required" in msg, msg
        pool["spec"]["scaling"]["webhook"] = {"secretRef": {"name": "hook"}}
        pool["metadata"]["name"] = f"ok-{mode}"
        kube.create(ImpVMRunnerPoolResource.from_dict(pool))


@pytest.mark.controlplane
def test_runner_group_only_with_org_scope(kube: Client, namespace: str) -> None:
    pool = _mutate(base_pool(namespace), "spec.platform.scope", {"repo": "my-org/app"})
    msg = rejected(kube, ImpVMRunnerPoolResource, pool)
    assert "platform.runnerGroup" in msg and "scope.org" in msg, msg
    del pool["spec"]["platform"]["runnerGroup"]
    kube.create(ImpVMRunnerPoolResource.from_dict(pool))


@pytest.mark.controlplane
def test_valid_variants_accepted(kube: Client, namespace: str) -> None:
    pool = base_pool(namespace, "pat")
    pool["spec"]["platform"]["tokenSource"] = "pat"
    pool["spec"]["platform"]["serverURL"] = "https://ghe.example.com"
    pool["spec"]["expireAfter"] = "0s"
    pool["spec"]["runnerLayer"] = DIGEST_B
    pool["spec"]["reaper"] = {"enabled": True, "maxJobSeconds": 3600}
    kube.create(ImpVMRunnerPoolResource.from_dict(pool))
    got = ImpVMRunnerPool.model_validate(
        kube.get(ImpVMRunnerPoolResource, "pat", namespace=namespace).to_dict()
    )
    assert got.spec.reaper is not None and got.spec.reaper.completed_grace_seconds == 300
    unpinned = base_pool(namespace, "unpinned")
    unpinned["spec"]["runnerLayer"] = "ghcr.io/x/runner:latest"
    unpinned["spec"]["allowUnpinnedImages"] = True
    kube.create(ImpVMRunnerPoolResource.from_dict(unpinned))


def _template(namespace: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "t", "namespace": namespace},
        "spec": {"classRef": {"name": "c"}, "image": DIGEST_A, **spec},
    }


@pytest.mark.controlplane
def test_template_rules(kube: Client, namespace: str) -> None:
    msg = rejected(kube, ImpVMTemplateResource, _template(namespace, image="debian:bookworm"))
    assert "spec.image" in msg and "digest" in msg, msg
    msg = rejected(kube, ImpVMTemplateResource, _template(namespace, runnerLayer="x:1"))
    assert "spec.runnerLayer" in msg and "digest" in msg, msg
    msg = rejected(kube, ImpVMTemplateResource, _template(namespace, expireAfter="59s"))
    assert "spec.expireAfter" in msg, msg
    msg = rejected(kube, ImpVMTemplateResource, _template(namespace, expireAfter="soon"))
    assert "spec.expireAfter" in msg, msg
    kube.create(ImpVMTemplateResource.from_dict(_template(namespace, expireAfter="1h")))


@pytest.mark.controlplane
def test_class_rules(kube: Client) -> None:
    bad = {"metadata": {"name": "tiny"}, "spec": {"vcpu": 0, "memoryMiB": 64, "diskGiB": 1}}
    msg = rejected(kube, ImpVMClassResource, bad)
    assert "spec.vcpu" in msg and "spec.memoryMiB" in msg, msg
    # a class's scheduling the Pod API would refuse is refused here, naming the field
    size = {"vcpu": 1, "memoryMiB": 512, "diskGiB": 1}
    for scheduling, field in (
        ({"nodeSelector": {"zone": "a b"}}, "spec.scheduling.nodeSelector"),
        ({"nodeSelector": {"not a key": "x"}}, "spec.scheduling.nodeSelector"),
        ({"tolerations": [{"key": "k", "value": "not valid!"}]}, "spec.scheduling.tolerations"),
        ({"tolerations": [{"operator": "Equal", "value": "v"}]}, "spec.scheduling.tolerations"),
        ({"priorityClassName": "Not_A_Name"}, "spec.scheduling.priorityClassName"),
    ):
        body = {"metadata": {"name": "sched"}, "spec": {**size, "scheduling": scheduling}}
        msg = rejected(kube, ImpVMClassResource, body)
        assert field in msg, (scheduling, msg)
    good = {
        "nodeSelector": {"imp.dev/host-size": "large"},
        "tolerations": [{"key": "imp.dev/vm-host", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "ci-high",
    }
    body = {"metadata": {"name": "sched-ok"}, "spec": {**size, "scheduling": good}}
    kube.create(ImpVMClassResource.from_dict(body))
    kube.delete(ImpVMClassResource, "sched-ok")


@pytest.mark.controlplane
def test_vm_rules(kube: Client, namespace: str) -> None:
    vm = {
        "metadata": {"name": "vm", "namespace": namespace},
        "spec": {"classRef": {"name": "c"}, "image": "busybox:latest"},
    }
    msg = rejected(kube, ImpVMResource, vm)
    assert "spec.image" in msg and "digest" in msg, msg
    vm["spec"]["image"] = DIGEST_A
    vm["spec"]["nodeName"] = "a"
    kube.create(ImpVMResource.from_dict(vm))
    obj = kube.get(ImpVMResource, "vm", namespace=namespace)
    obj["spec"]["nodeName"] = "b"
    with pytest.raises(ApiError) as info:
        kube.replace(obj)
    assert "nodeName cannot be changed" in str(info.value.status.message)


def _public_key_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


@pytest.mark.controlplane
def test_verify_rules(kube: Client, namespace: str) -> None:
    bad_ref = _template(namespace, verify={"publicKeySecretRef": {"name": "Not_A_Name"}})
    msg = rejected(kube, ImpVMTemplateResource, bad_ref)
    assert "spec.verify.publicKeySecretRef.name" in msg, msg
    bad_key = _template(namespace, verify={"publicKeySecretRef": {"name": "k", "key": "a/b"}})
    msg = rejected(kube, ImpVMTemplateResource, bad_key)
    assert "spec.verify.publicKeySecretRef.key" in msg, msg
    msg = rejected(kube, ImpVMTemplateResource, _template(namespace, verify={}))
    assert "spec.verify.publicKeySecretRef" in msg, msg
    kube.create(
        ImpVMTemplateResource.from_dict(
            _template(namespace, verify={"publicKeySecretRef": {"name": "signing-key"}})
        )
    )
    t = kube.get(ImpVMTemplateResource, "t", namespace=namespace)
    assert t["spec"]["verify"]["publicKeySecretRef"] == {"name": "signing-key", "key": "cosign.pub"}

    pem, other = _public_key_pem(), _public_key_pem()

    def vm(name: str, verify: dict[str, Any] | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"classRef": {"name": "c"}, "image": DIGEST_A}
        if verify is not None:
            spec["verify"] = verify
        return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}

    for junk in ("not a key", "-----BEGIN PUBLIC KEY-----\n!!!\n-----END PUBLIC KEY-----\n"):
        msg = rejected(kube, ImpVMResource, vm("bad", {"publicKey": junk}))
        assert "spec.verify.publicKey" in msg and "PEM public key" in msg, msg
    msg = rejected(kube, ImpVMResource, vm("bad", {}))
    assert "spec.verify.publicKey" in msg, msg

    kube.create(ImpVMResource.from_dict(vm("signed", {"publicKey": pem})))
    kube.create(ImpVMResource.from_dict(vm("plain", None)))
    # The key a VM is verified with is fixed at creation: not changed, removed or added later.
    for name, verify in (
        ("signed", {"publicKey": other}),
        ("signed", None),
        ("plain", {"publicKey": pem}),
    ):
        obj = kube.get(ImpVMResource, name, namespace=namespace)
        if verify is None:
            obj["spec"].pop("verify")
        else:
            obj["spec"]["verify"] = verify
        with pytest.raises(ApiError) as info:
            kube.replace(obj)
        assert info.value.status.code == 422
        assert "verify cannot be added, changed or removed" in str(info.value.status.message)
    assert kube.get(ImpVMResource, "signed", namespace=namespace)["spec"]["verify"] == {
        "publicKey": pem
    }


def test_models_parse_seed_example() -> None:
    docs = list(yaml.safe_load_all(SEED_EXAMPLE.read_text()))
    pool = ImpVMRunnerPool.model_validate(docs[2])
    assert pool.spec.template_name == "gh-runner"
    assert pool.spec.platform.runner_group == "omni-runner"


def test_kubectl_is_built(control_plane: ControlPlane) -> None:
    assert Path(control_plane.kubectl).is_file()


@pytest.mark.controlplane
def test_warm_pool_accepted_and_its_state_round_trips_through_the_status(
    kube: Client, namespace: str
) -> None:
    pool = base_pool(namespace, "warm")
    pool["spec"]["scaling"]["minIdle"] = 0
    pool["spec"]["scaling"]["warmPool"] = {
        "mode": "adaptive",
        "maxIdle": 4,
        "safetyPercent": 250,
        "arrivalHalfLifeSeconds": 300,
        "readyHalfLifeSamples": 5,
        "schedules": [
            {
                "name": "working-hours",
                "start": "0 8 * * MON-FRI",
                "end": "0\t18 * * mon-fri",
                "timeZone": "Europe/Berlin",
                "minIdle": 2,
            },
            {"name": "nights", "start": "*/30 22-23 * * *", "end": "0 6 * * *", "minIdle": 0},
        ],
    }
    kube.create(ImpVMRunnerPoolResource.from_dict(pool))
    got = ImpVMRunnerPool.model_validate(
        kube.get(ImpVMRunnerPoolResource, "warm", namespace=namespace).to_dict()
    )
    assert got.spec.scaling is not None
    policy = WarmPoolPolicy.from_spec(got.spec.scaling)
    assert (policy.mode, policy.max_idle, policy.safety) == ("adaptive", 4, 2.5)
    assert [s.name for s in policy.schedules] == ["working-hours", "nights"]
    wp = got.spec.scaling.warm_pool
    assert wp is not None and wp.schedules is not None and wp.schedules[1].time_zone == "UTC"

    state = WarmPoolState(
        arrival_rate_per_minute=0.1 + 0.2,  # not representable exactly in binary
        ready_seconds=17.123456789,
        ready_samples=12,
        updated_at=datetime(2026, 3, 2, 8, 0, 1, 123456, tzinfo=UTC),
    )
    status = {"warmPool": state.to_status(target=3, active_schedule="working-hours").wire()}
    kube.patch(
        ImpVMRunnerPoolResource.Status,
        "warm",
        {"status": status},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )
    stored = ImpVMRunnerPool.model_validate(
        kube.get(ImpVMRunnerPoolResource, "warm", namespace=namespace).to_dict()
    )
    assert stored.status is not None and stored.status.warm_pool is not None
    assert WarmPoolState.from_status(stored.status.warm_pool) == state
    assert stored.status.warm_pool.target == 3


@pytest.mark.controlplane
def test_pool_without_warm_pool_stays_fixed(kube: Client, namespace: str) -> None:
    kube.create(ImpVMRunnerPoolResource.from_dict(base_pool(namespace, "plain")))
    got = ImpVMRunnerPool.model_validate(
        kube.get(ImpVMRunnerPoolResource, "plain", namespace=namespace).to_dict()
    )
    assert got.spec.scaling is not None and got.spec.scaling.warm_pool is None
    policy = WarmPoolPolicy.from_spec(got.spec.scaling)
    assert (policy.mode, policy.min_idle, policy.max_idle) == ("fixed", 1, 1)


def test_pool_names_are_capped_at_the_label_limit(kube: Client, namespace: str) -> None:
    """A pool's name is the value of the imp.dev/runner-pool label on its VMs: at most 63."""
    msg = rejected(kube, ImpVMRunnerPoolResource, base_pool(namespace, "p" * 64))
    assert "metadata.name" in msg and "63" in msg, msg
    kube.create(ImpVMRunnerPoolResource.from_dict(base_pool(namespace, "p" * 63)))


@pytest.mark.controlplane
def test_ready_column_shows_a_broken_pool(
    control_plane: ControlPlane, kube: Client, namespace: str
) -> None:
    kube.create(ImpVMRunnerPoolResource.from_dict(base_pool(namespace, "broken")))
    ready = {
        "type": "Ready",
        "status": "False",
        "reason": "CredentialsError",
        "message": "credentials Secret 'github-runner-app' not found",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    kube.patch(
        ImpVMRunnerPoolResource.Status,
        "broken",
        {"status": {"idle": 0, "busy": 0, "desired": 1, "conditions": [ready]}},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )
    table = kubectl(control_plane, "get", "imprp", "-n", namespace)
    assert table.returncode == 0, table.stderr
    header, row = (line.split() for line in table.stdout.splitlines()[:2])
    assert dict(zip(header, row, strict=False))["READY"] == "False", table.stdout
