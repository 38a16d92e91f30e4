"""ImpVMRunnerPool: the runner to keep (platform scope, template, class, labels), how it scales
(:mod:`impvm.api.scaling_types`) and the status the pool pass writes."""

from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import Field

from impvm.api.meta import (
    _CONDITIONS_DESC,
    DURATION_PATTERN,
    MAX_POOL_NAME,
    NAME_PATTERN,
    REPO_PATTERN,
    ApiModel,
    Condition,
    _digest_rule,
    _expire_after_rule,
    cel,
)
from impvm.api.network_types import NetworkSpec
from impvm.api.scaling_types import ReaperSpec, ScalingSpec

# --------------------------------------------------------------------------------------------
# ImpVMRunnerPool


class PlatformScope(ApiModel):
    """Where runners register: one organisation or one repository (exactly one)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "has(self.org) != has(self.repo)",
            "platform.scope: exactly one of org or repo must be set",
        ),
        cel(
            "!has(self.repo) || !(self.repo.endsWith('/.') || self.repo.endsWith('/..'))",
            "platform.scope.repo: '.' and '..' are not repository names",
            ".repo",
        ),
    ]

    org: str | None = Field(
        default=None,
        min_length=1,
        max_length=39,
        pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$",
        description="GitHub organisation login.",
    )
    repo: str | None = Field(
        default=None,
        pattern=REPO_PATTERN,
        max_length=140,
        description="Repository as owner/name.",
    )


class Platform(ApiModel):
    """The CI platform runners connect to."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.runnerGroup) || has(self.scope.org)",
            "platform.runnerGroup is only allowed with platform.scope.org (repository-scoped "
            "pools cannot use an organisation runner group)",
            ".runnerGroup",
        ),
    ]

    type: Literal["github-actions"] = Field(description="CI platform; github-actions.")
    scope: PlatformScope = Field(description="Organisation or repository the runners join.")
    runner_group: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="Organisation runner group name (org scope only); default group if unset.",
    )
    credentials_secret: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description="Secret with github_app_id, github_app_installation_id, "
        "github_app_private_key (github_app) or github_token (pat).",
    )
    token_source: Literal["github_app", "pat"] = Field(
        default="github_app",
        description="github_app (recommended) or pat (a long-lived personal access token).",
    )
    server_url: str | None = Field(
        default=None,
        alias="serverURL",
        pattern=r"^https://[^\s/]+(/[^\s]*)?$",
        max_length=512,
        description="GitHub Enterprise Server URL (https://HOST, TLS only: tokens travel on it); "
        "the API is HOST/api/v3. "
        "Default: github.com.",
    )


class ImpVMRunnerPoolSpec(ApiModel):
    """What runner to keep and how many."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.platform.type != 'github-actions' || has(self.scaling)",
            "scaling is required for github-actions pools",
            ".scaling",
        ),
        *[
            cel(
                f"self.platform.type != 'github-actions' || !has(self.scaling) || "
                f"has(self.scaling.{f})",
                f"scaling.{f} is required for github-actions pools",
                ".scaling",
            )
            for f in ("minIdle", "maxConcurrent", "scaleUpStep", "cooldownSeconds")
        ],
        _digest_rule("runnerLayer"),
    ]

    template_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description="ImpVMTemplate giving base image and class.",
    )
    labels: list[str] = Field(
        default_factory=list,
        max_length=100,
        description="Runner labels passed to GitHub in the JIT request (besides self-hosted); a "
        "job runs here only if all its labels are in this set.",
        json_schema_extra={
            # GitHub runner labels: no commas (runs-on lists), no whitespace or control
            # characters; each label once
            "items": {
                "type": "string",
                "minLength": 1,
                "maxLength": 256,
                "pattern": r"^[^,\s\x00-\x1f]+$",
            },
            "x-kubernetes-list-type": "set",
        },
    )
    platform: Platform
    runner_layer: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="OCI runner layer pinned by digest; overrides the template's.",
    )
    allow_unpinned_images: bool | None = Field(
        default=None, description="Opt out of digest pinning for runnerLayer."
    )
    scaling: ScalingSpec | None = Field(default=None, description="Capacity limits and demand.")
    bootstrap_timeout_seconds: int = Field(
        default=300,
        ge=30,
        le=86400,
        description="Seconds a VM's runner may take to come online before the VM is replaced.",
    )
    expire_after: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Hard deadline of each VM (Go duration, 0s or >= 60s); overrides the "
        "template's.",
        json_schema_extra={"x-kubernetes-validations": [_expire_after_rule("expireAfter")]},
    )
    reaper: ReaperSpec | None = Field(default=None, description="Reaper for stuck runners.")
    network: NetworkSpec | None = Field(
        default=None,
        description="Network of the pool's VMs (copied to each VM); its egress policy applies "
        "on top of the class's.",
    )


class PollStatus(ApiModel):
    """Result of the last poll of GitHub for jobs."""

    time: datetime | None = Field(default=None, description="When the poll finished.")
    queued_jobs: int | None = Field(default=None, ge=0, description="Queued matching jobs seen.")
    api_calls: int | None = Field(default=None, ge=0, description="Requests made (304s too).")
    not_modified: int | None = Field(default=None, ge=0, description="Requests answered 304.")
    error: str | None = Field(default=None, description="Why the poll failed, if it did.")


class RateLimitStatus(ApiModel):
    """The core REST rate limit of the pool's installation as GitHub last reported it
    (``x-ratelimit-*`` headers; GitHub docs, "Rate limits for the REST API")."""

    limit: int | None = Field(default=None, ge=0, description="Requests per hour.")
    remaining: int | None = Field(default=None, ge=0, description="Requests left.")
    reset_at: datetime | None = Field(default=None, description="When the window resets.")
    installation: str | None = Field(
        default=None,
        max_length=500,
        description="Whose limit it is: the API host and the App's installation (or the "
        "credentials Secret of a token); pools with the same value share one limit.",
    )


class TimingSummary(ApiModel):
    """p50/p95 of one duration over the pool's VMs of the last hour."""

    count: int | None = Field(default=None, ge=0, description="Samples in the window.")
    p50_seconds: float | None = Field(default=None, ge=0)
    p95_seconds: float | None = Field(default=None, ge=0)


class PoolTimings(ApiModel):
    """Durations over the last hour (see docs/architecture.md, per-job timings)."""

    job_pickup: TimingSummary | None = Field(
        default=None, description="A job's wait from queued to in progress."
    )
    vm_boot: TimingSummary | None = Field(
        default=None, description="From the agent starting the VM to its runner running."
    )
    runner_registration: TimingSummary | None = Field(
        default=None, description="From the ImpVM's creation to its runner online on GitHub."
    )


class WarmPoolStatus(ApiModel):
    """The warm pool's estimates, carried from pass to pass (Kubernetes is the database: a
    restarted operator resumes from here). Changed only by observed events."""

    arrival_rate_per_minute: float | None = Field(
        default=None, ge=0, description="Job arrival-rate EWMA (jobs per minute) at updatedAt."
    )
    ready_seconds: float | None = Field(
        default=None, ge=0, description="Time-to-ready EWMA: VM created to runner online (s)."
    )
    ready_samples: int | None = Field(
        default=None, ge=0, description="Time-to-ready samples folded into readySeconds."
    )
    updated_at: datetime | None = Field(
        default=None,
        description="Events observed up to this time (RFC 3339, microseconds) are folded in.",
    )
    target: int | None = Field(
        default=None, ge=0, description="Idle runners the warm pool asked for at updatedAt."
    )
    active_schedule: str | None = Field(
        default=None, description="Name of the open schedules window that set minIdle, if any."
    )


class ImpVMRunnerPoolStatus(ApiModel):
    """Observed state of a pool."""

    observed_generation: int | None = Field(default=None, ge=0)
    starting: int | None = Field(
        default=None, ge=0, description="VMs whose runner is not yet online."
    )
    idle: int | None = Field(default=None, ge=0, description="Online runners without a job.")
    busy: int | None = Field(default=None, ge=0, description="Runners running a job.")
    total: int | None = Field(default=None, ge=0, description="VMs of the pool.")
    desired: int | None = Field(default=None, ge=0, description="VMs the controller wants.")
    pending_jobs: int | None = Field(
        default=None, ge=0, description="Queued matching jobs not yet assigned a runner."
    )
    outdated: int | None = Field(
        default=None,
        ge=0,
        description="VMs made from an older template (image, runner layer or class); idle ones "
        "are replaced, busy ones finish their job first.",
    )
    last_scale_up_time: datetime | None = Field(default=None)
    last_poll: PollStatus | None = Field(default=None)
    timings: PoolTimings | None = Field(default=None, description="p50/p95 over the last hour.")
    rate_limit: RateLimitStatus | None = Field(
        default=None, description="The installation's rate limit, as of the last status write."
    )
    warm_pool: WarmPoolStatus | None = Field(default=None, description="Warm pool estimates.")
    conditions: list[Condition] | None = Field(
        default=None,
        description=_CONDITIONS_DESC,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ImpVMRunnerPool(ApiModel):
    """A pool of ephemeral GitHub Actions runners, one VM each."""

    kind: ClassVar[str] = "ImpVMRunnerPool"
    plural: ClassVar[str] = "impvmrunnerpools"
    short_names: ClassVar[list[str]] = ["imprp"]
    namespaced: ClassVar[bool] = True
    #: Rules on the whole object (only metadata.name and generateName are visible to them).
    object_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            f"size(self.metadata.name) <= {MAX_POOL_NAME}",
            f"metadata.name: a pool name is at most {MAX_POOL_NAME} characters (it is the value "
            "of the imp.dev/runner-pool label on its VMs)",
        )
    ]
    printer_columns: ClassVar[list[dict[str, Any]]] = [
        {"name": "Platform", "type": "string", "jsonPath": ".spec.platform.type"},
        {"name": "Template", "type": "string", "jsonPath": ".spec.templateName"},
        {"name": "Idle", "type": "integer", "jsonPath": ".status.idle"},
        {"name": "Busy", "type": "integer", "jsonPath": ".status.busy"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desired"},
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: ImpVMRunnerPoolSpec
    status: ImpVMRunnerPoolStatus | None = None
