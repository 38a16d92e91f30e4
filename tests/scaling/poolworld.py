"""Builders of pool-pass worlds for the pure tests, and a model of what the executor does to the
world when it carries a plan out (Kubernetes and GitHub as the plan leaves them)."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from impvm.api.conditions import merge_conditions
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
from impvm.scaling.names import secret_name
from impvm.scaling.pool import RunnerView
from impvm.scaling.poolpass import Outcome, PoolPlan, current_template_hash
from impvm.scaling.world import (
    ClassObj,
    GitHubView,
    PoolObj,
    PoolWorld,
    TemplateObj,
    VMObj,
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
) -> VMObj:
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
    made = VMObj(
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
        hash_ = made.made_from(CLASS)
        made = dataclasses.replace(made, annotations={TEMPLATE_HASH_ANNOTATION: hash_})
    return made


def reg(rid: int, suffix: str, *, online: bool = True, busy: bool = False) -> RunnerView:
    return RunnerView(id=rid, name=PREFIX + suffix, online=online, busy=busy)


def world(
    vms: tuple[VMObj, ...] = (),
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


# --------------------------------------------------------------------------------------------
# A model of the executor


_ids = itertools.count(900000)


def apply(w: PoolWorld, plan: PoolPlan, outcome: Outcome | None = None) -> PoolWorld:
    """``w`` after ``plan`` was carried out as the executor would (every act succeeding, GitHub
    answering; a busy runner refuses its deregistration), the status written and the in-memory
    state kept. The next pass observes the result at the same clock reading."""
    assert plan.poll is None and plan.settlement is not None
    vms = {v.name: v for v in w.vms}
    runners = {r.id: r for r in w.github.runners or ()}
    secrets = set(w.secrets)
    for r in plan.releases:
        vms.pop(r.name, None)
    for p in plan.lost:
        v = vms[p.name]
        vms[p.name] = dataclasses.replace(
            v, status=v.status.model_copy(update={"phase": p.status["phase"]})
        )
    for d in plan.deletions:
        reg_ = runners.get(d.runner_id) if d.runner_id is not None else None
        if d.deregister and reg_ is not None:
            if reg_.busy:
                continue
            del runners[reg_.id]
        elif d.deregister_first and d.runner_id is not None:
            continue
        vms.pop(d.name, None)
    for r in plan.registrations:
        runners.pop(r.runner_id, None)

    def mint(name: str, stale: int | None) -> None:
        if stale is not None:
            runners.pop(stale, None)
        rid = next(_ids)
        runners[rid] = RunnerView(id=rid, name=name, online=False, busy=False)
        v = vms[name]
        secrets.add(secret_name(name))
        spec = v.spec.model_copy(update={"runner_config_secret": secret_name(name)})
        status = v.status.model_copy(update={"runner": RunnerStatus(id=rid, name=name)})
        vms[name] = dataclasses.replace(v, spec=spec, status=status)

    for m in plan.mints:
        if m.record_only:
            v = vms[m.vm]
            spec = v.spec.model_copy(update={"runner_config_secret": m.secret})
            vms[m.vm] = dataclasses.replace(v, spec=spec)
        else:
            mint(m.vm, m.stale_runner_id)
    digest = current_template_hash(w)
    for _ in range(plan.create):
        assert plan.new_vm is not None
        name = PREFIX + f"{next(_ids) % 16**6:06x}"
        vms[name] = VMObj(
            namespace="ns",
            name=name,
            uid=f"uid-{name}",
            resource_version="1",
            created_at=w.now,
            spec=ImpVMSpec.model_validate(dict(plan.new_vm.spec)),
            annotations=dict(plan.new_vm.annotations),
            owner_uids=frozenset({w.pool.uid}),
        )
        assert plan.new_vm.annotations["imp.dev/template-hash"] == digest
        mint(name, None)
    for s in plan.sync:
        v = vms.get(s.name)
        if v is None:
            continue
        update: dict[str, Any] = {}
        if "runner" in s.status:
            cur = v.status.runner.model_dump() if v.status.runner else {}
            update["runner"] = RunnerStatus.model_validate({**cur, **s.status["runner"]})
        if "job" in s.status:
            update["job"] = JobStatus.model_validate(s.status["job"])
        vms[s.name] = dataclasses.replace(v, status=v.status.model_copy(update=update))
    done = plan.settlement
    stored = dict(w.pool.stored_status)
    if done.write:
        stored = {
            **stored,
            **done.status,
            "conditions": merge_conditions(stored.get("conditions") or [], done.conditions),
        }
    pool = dataclasses.replace(
        w.pool, stored_status=stored, status=ImpVMRunnerPoolStatus.model_validate(stored)
    )
    return dataclasses.replace(
        w,
        pool=pool,
        vms=tuple(vms.values()),
        secrets=frozenset(secrets),
        github=dataclasses.replace(w.github, runners=tuple(runners.values())),
        backoff=done.backoff,
        poll=done.poll,
        warm=done.warm if done.warm is not None else w.warm,
    )
