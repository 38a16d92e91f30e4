"""ImpVM: one microVM running one ephemeral runner for one job; its spec (from its pool's
template) and the status its node's agent reports (runner, job, timings; ARC's
EphemeralRunner status)."""

from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import Field

from impvm.api.meta import (
    _CONDITIONS_DESC,
    DURATION_PATTERN,
    ApiModel,
    Condition,
    LocalObjectReference,
    VMPhase,
    _digest_rule,
    _expire_after_rule,
    cel,
)
from impvm.api.network_types import NetworkSpec
from impvm.api.template_types import VMVerifySpec

# --------------------------------------------------------------------------------------------
# ImpVM


class RunnerStatus(ApiModel):
    """The GitHub runner registered from this VM (ARC: runnerId, runnerName)."""

    id: int | None = Field(default=None, ge=0, description="GitHub runner id.")
    name: str | None = Field(default=None, description="Runner name (the VM's name).")
    online: bool | None = Field(default=None, description="GitHub reports the runner online.")
    busy: bool | None = Field(default=None, description="GitHub reports the runner busy.")


class JobStatus(ApiModel):
    """The workflow job this VM's runner took (ARC: jobId, workflowRunId, jobRepositoryName)."""

    id: int | None = Field(default=None, ge=0, description="Workflow job id.")
    workflow_run_id: int | None = Field(default=None, ge=0, description="Workflow run id.")
    repository: str | None = Field(default=None, description="Repository as owner/name.")
    started_at: datetime | None = Field(default=None, description="When the job started.")
    completed_at: datetime | None = Field(default=None, description="When the job completed.")


class ImpVMSpec(ApiModel):
    """One VM. Created by a pool from its template."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        _digest_rule("image"),
        _digest_rule("runnerLayer"),
        cel(
            "!has(oldSelf.nodeName) || oldSelf.nodeName == '' || self.nodeName == oldSelf.nodeName",
            "nodeName cannot be changed once the VM is bound to a node",
            ".nodeName",
        ),
        cel(
            "has(self.verify) == has(oldSelf.verify) && "
            "(!has(self.verify) || self.verify == oldSelf.verify)",
            "verify cannot be added, changed or removed after the VM is created",
            ".verify",
        ),
        cel(
            "has(self.network) == has(oldSelf.network) && "
            "(!has(self.network) || self.network == oldSelf.network)",
            "network cannot be changed once the VM exists",
            ".network",
        ),
    ]

    class_ref: LocalObjectReference = Field(description="The ImpVMClass giving the VM's size.")
    image: str = Field(min_length=1, max_length=1024, description="OCI base image by digest.")
    runner_layer: str | None = Field(
        default=None, min_length=1, max_length=1024, description="OCI runner layer by digest."
    )
    allow_unpinned_images: bool | None = Field(default=None, description="Opt out of pinning.")
    lifecycle: Literal["ephemeral", "persistent"] = Field(
        default="ephemeral",
        description="ephemeral: the VM runs one job and is removed (pool VMs always are).",
    )
    runner_config_secret: str | None = Field(
        default=None,
        max_length=253,
        description="Secret (owned by this VM) whose key jitconfig holds the runner's JIT config.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline from the VM's start (Go duration, 0s or >= 60s).",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    node_name: str | None = Field(
        default=None, max_length=253, description="Node (agent) the VM is bound to."
    )
    verify: VMVerifySpec | None = Field(
        default=None,
        description="Signature requirement copied from the template (immutable); unset: none.",
    )
    network: NetworkSpec | None = Field(
        default=None,
        description="Network of this VM (from its pool); its egress policy applies on top of "
        "the class's. Fixed once the VM exists.",
    )


class VMTimings(ApiModel):
    """When each step of a VM's one job happened (the agent writes scheduledAt, bootedAt and
    finishedAt; the operator createdAt, runnerOnlineAt, jobQueuedAt and jobStartedAt). Its
    deletion is the histogram ``impvm_vm_lifetime_seconds`` (the object is gone)."""

    created_at: datetime | None = Field(default=None, description="The ImpVM was created.")
    scheduled_at: datetime | None = Field(default=None, description="Its node's agent admitted it.")
    booted_at: datetime | None = Field(default=None, description="Its runner process runs.")
    runner_online_at: datetime | None = Field(
        default=None,
        description="GitHub first listed its runner online, or its job started (a short job's "
        "runner may finish before any runner list shows it).",
    )
    job_queued_at: datetime | None = Field(
        default=None, description="impvm first saw its job queued."
    )
    job_started_at: datetime | None = Field(
        default=None, description="Its job went in progress (GitHub's started_at)."
    )
    finished_at: datetime | None = Field(default=None, description="Its runner exited.")


class ImpVMStatus(ApiModel):
    """Observed state of a VM."""

    phase: VMPhase | None = Field(default=None, description="Lifecycle phase.")
    node_name: str | None = Field(default=None, description="Node running the VM.")
    runner: RunnerStatus | None = None
    job: JobStatus | None = None
    started_at: datetime | None = Field(default=None, description="When the VM started.")
    finished_at: datetime | None = Field(default=None, description="When the VM stopped.")
    exit_code: int | None = Field(
        default=None,
        description=(
            "Exit status of the runner as its VM reported it (the job, root in the VM, can "
            "choose it): shown, never used to decide anything."
        ),
    )
    exit_reason: str | None = Field(
        default=None, description="Why the VM ended (Completed, Error, DeadlineExceeded, ...)."
    )
    message: str | None = Field(default=None, description="Detail (console tail on failure).")
    timings: VMTimings | None = Field(default=None, description="Per-job timings.")
    console_tail: str | None = Field(
        default=None,
        max_length=4000,
        description="A failed VM's last console lines (JIT config scrubbed).",
    )
    console_log: str | None = Field(
        default=None,
        max_length=1000,
        description="<node>:<path> of a failed VM's kept console (impvm logs prints it).",
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description=_CONDITIONS_DESC,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ImpVM(ApiModel):
    """A single-use runner VM."""

    kind: ClassVar[str] = "ImpVM"
    plural: ClassVar[str] = "impvms"
    short_names: ClassVar[list[str]] = ["impvm"]
    namespaced: ClassVar[bool] = True
    printer_columns: ClassVar[list[dict[str, Any]]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"},
        {"name": "Runner", "type": "string", "jsonPath": ".status.runner.name"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    #: Fields a list/watch may select on (a node agent watches ``spec.nodeName=<node>`` and ``=``).
    selectable_fields: ClassVar[list[dict[str, str]]] = [{"jsonPath": ".spec.nodeName"}]

    spec: ImpVMSpec
    status: ImpVMStatus | None = None


#: Every kind, in the order the CRDs are rendered.
