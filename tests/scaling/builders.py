"""Builders of pool-pass worlds for the pure tests: pools, VMs (the one VM read model), GitHub's
registrations, and a world with its template and class found. Nothing here models what the
executor does: tests that follow a pass's acts to the next pass drive the real executor against
a real API server and the GitHub stand-in (tests/operator)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from impvm.api.models import (
    TEMPLATE_HASH_ANNOTATION,
    ImpVMClassSpec,
    ImpVMRunnerPoolSpec,
    ImpVMRunnerPoolStatus,
    ImpVMSpec,
    ImpVMStatus,
    ImpVMTemplateSpec,
    JobStatus,
    RunnerStatus,
)
from impvm.api.vm import VM
from impvm.scaling.names import secret_name
from impvm.scaling.poolpass import (
    ActsDone,
    ClassObj,
    GitHubView,
    PassConclusion,
    PoolActs,
    PoolObj,
    PoolWorld,
    RunnerView,
    TemplateObj,
    conclude_pass,
    pool_acts,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
MONO = 5000.0
IMAGE = "registry.example/base@sha256:" + "1" * 64
NEW_IMAGE = "registry.example/base@sha256:" + "3" * 64
LAYER = "registry.example/layer@sha256:" + "2" * 64
UID = "0123456789abcdef"
PREFIX = "pool-01234-"


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def pool_obj(
    *,
    status: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    spec: dict[str, Any] | None = None,
    **scaling: Any,
) -> PoolObj:
    sc: dict[str, Any] = {
        "mode": "manual",
        "minIdle": 1,
        "maxConcurrent": 5,
        "scaleUpStep": 5,
        "cooldownSeconds": 60,
        **scaling,
    }
    body: dict[str, Any] = {
        "templateName": "tpl",
        "labels": ["imp"],
        "platform": {
            "type": "github-actions",
            "scope": {"org": "octo"},
            "credentialsSecret": "creds",
        },
        "scaling": sc,
        **(spec or {}),
    }
    stored = status or {}
    return PoolObj(
        namespace="ns",
        name="pool",
        uid=UID,
        generation=3,
        spec=ImpVMRunnerPoolSpec.model_validate(body),
        status=ImpVMRunnerPoolStatus.model_validate(stored),
        stored_status=stored,
        annotations=annotations or {},
    )


TEMPLATE = TemplateObj(
    name="tpl",
    spec=ImpVMTemplateSpec.model_validate(
        {"classRef": {"name": "small"}, "image": IMAGE, "runnerLayer": LAYER}
    ),
)
CLASS = ClassObj(
    name="small", spec=ImpVMClassSpec.model_validate({"vcpu": 2, "memoryMiB": 2048, "diskGiB": 10})
)


def vm(
    suffix: str,
    *,
    phase: str | None = "Running",
    created: float = 10.0,
    secret: bool = True,
    runner: tuple[int, bool, bool] | None = None,
    job: int | None = None,
    deleting: bool = False,
    node: str | None = None,
    image: str = IMAGE,
    finalizers: tuple[str, ...] = (),
    annotated: bool = True,
) -> VM:
    """A VM named ``PREFIX + suffix`` (6 hex). ``runner``: recorded (id, online, busy).
    ``annotated``: it carries the template hash it was made with (of :data:`CLASS`), as every
    VM the controller creates does."""
    name = PREFIX + suffix
    spec: dict[str, Any] = {"classRef": {"name": "small"}, "image": image, "runnerLayer": LAYER}
    if secret:
        spec["runnerConfigSecret"] = secret_name(name)
    if node:
        spec["nodeName"] = node
    status = ImpVMStatus(
        phase=phase,  # type: ignore[arg-type]
        runner=RunnerStatus(id=runner[0], name=name, online=runner[1], busy=runner[2])
        if runner
        else None,
        job=JobStatus(id=job, workflow_run_id=1, repository="octo/app") if job else None,
    )
    made = VM(
        namespace="ns",
        name=name,
        uid=f"uid-{suffix}",
        resource_version="1",
        created_at=ago(created),
        spec=ImpVMSpec.model_validate(spec),
        status=status,
        deleting=deleting,
        finalizers=finalizers,
        owner_uids=frozenset({UID}),
    )
    if annotated:
        hash_ = made.made_from(CLASS.name, CLASS.spec)
        made = dataclasses.replace(made, annotations={TEMPLATE_HASH_ANNOTATION: hash_})
    return made


def reg(rid: int, suffix: str, *, online: bool = True, busy: bool = False) -> RunnerView:
    return RunnerView(id=rid, name=PREFIX + suffix, online=online, busy=busy)


def world(
    vms: tuple[VM, ...] = (),
    runners: tuple[RunnerView, ...] | None = (),
    *,
    pool: PoolObj | None = None,
    **kw: Any,
) -> PoolWorld:
    """A world with template and class found, GitHub answering with ``runners``."""
    secrets = frozenset(vm.spec.runner_config_secret for vm in vms if vm.spec.runner_config_secret)
    fields: dict[str, Any] = {
        "pool": pool or pool_obj(),
        "now": NOW,
        "mono": MONO,
        "template": TEMPLATE,
        "vm_class": CLASS,
        "vms": vms,
        "secrets": secrets,
        "github": GitHubView(connected=True, runners=runners),
    }
    fields.update(kw)
    return PoolWorld(**fields)


def one_pass(w: PoolWorld, done: ActsDone | None = None) -> tuple[PoolActs, PassConclusion]:
    """The pure pass over ``w``: its acts and its conclusion as if every act succeeded (the VMs
    it makes created), or with ``done``."""
    acts = pool_acts(w)
    return acts, conclude_pass(w, acts, done or ActsDone(created=acts.create))
