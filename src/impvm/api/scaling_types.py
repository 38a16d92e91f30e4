"""How an ImpVMRunnerPool scales: demand modes (polling, webhook, hybrid), the warm pool
(fixed, scheduled or adaptive) and the reaper."""

from typing import Any, ClassVar, Literal

from pydantic import Field

from impvm.api.meta import ApiModel, cel


class PollingSpec(ApiModel):
    """Polling of GitHub for queued jobs."""

    enabled: bool = Field(default=True, description="Whether the operator polls GitHub.")
    interval_seconds: int = Field(
        default=30, ge=5, le=3600, description="Seconds between polls of queued jobs."
    )


class SecretKeyRef(ApiModel):
    """A Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")


class WebhookSpec(ApiModel):
    """workflow_job webhook deliveries."""

    secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret whose key webhook_secret verifies X-Hub-Signature-256."
    )


def _cron_field(value: str) -> str:
    """One crontab(5) field: ``*`` or a value/range, with an optional step, comma-separated."""
    item = rf"(\*|({value})(-({value}))?)(/[1-9][0-9]?)?"
    return rf"{item}(,{item})*"


def _any_case(names: str) -> str:
    """``jan|feb`` as ``[Jj][Aa][Nn]|[Ff][Ee][Bb]``: ASCII only (a case-insensitive flag would
    also fold non-ASCII letters such as U+017F into ``s``)."""
    return "|".join("".join(f"[{c.upper()}{c}]" for c in n) for n in names.split("|"))


_MONTH_NAMES = _any_case("jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec")
_DAY_NAMES = _any_case("sun|mon|tue|wed|thu|fri|sat")
#: Five-field cron expression (minute hour day-of-month month day-of-week) as crontab(5) and a
#: Kubernetes CronJob's ``schedule`` write them: numbers, three-letter names (any case), ``*``,
#: ranges, lists and steps, separated by spaces or tabs. The values' ranges are checked here so
#: the API server rejects ``61 * * * *``; croniter evaluates what is accepted.
CRON_PATTERN = (
    r"^"
    + r"[ \t]+".join(
        _cron_field(v)
        for v in (
            r"[0-5]?[0-9]",
            r"[01]?[0-9]|2[0-3]",
            r"0?[1-9]|[12][0-9]|3[01]",
            rf"0?[1-9]|1[0-2]|{_MONTH_NAMES}",
            rf"[0-7]|{_DAY_NAMES}",
        )
    )
    + r"$"
)
#: IANA time zone name (``UTC``, ``Europe/Berlin``, ``America/Argentina/Buenos_Aires``); whether
#: the zone exists is checked against the time zone database when the pool is evaluated.
TIME_ZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,2}$"


class WarmPoolSchedule(ApiModel):
    """A recurring window with its own minIdle, like a KEDA cron scaler's start/end pair: the
    window opens whenever start matches and closes whenever end matches, both read as wall-clock
    times in timeZone (so 0 8 * * 1-5 is 08:00 local time in winter and in summer)."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.start != self.end",
            "scaling.warmPool.schedules[].end must differ from start (the window would be empty)",
            ".end",
        ),
    ]

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the window (shown in status.warmPool.activeSchedule).",
    )
    start: str = Field(
        max_length=200,
        pattern=CRON_PATTERN,
        description="Cron expression (5 fields) of the window's opening times, e.g. 0 8 * * 1-5.",
    )
    end: str = Field(
        max_length=200,
        pattern=CRON_PATTERN,
        description="Cron expression (5 fields) of the window's closing times, e.g. 0 18 * * 1-5.",
    )
    time_zone: str = Field(
        default="UTC",
        max_length=64,
        pattern=TIME_ZONE_PATTERN,
        description="IANA time zone start and end are read in (default UTC).",
    )
    min_idle: int = Field(
        ge=0, le=10000, description="minIdle while the window is open (replaces scaling.minIdle)."
    )


#: Defaults of the adaptive warm pool (see :mod:`impvm.scaling.warmpool`).
DEFAULT_SAFETY_PERCENT = 250
DEFAULT_ARRIVAL_HALF_LIFE_SECONDS = 300
DEFAULT_READY_HALF_LIFE_SAMPLES = 10

_ADAPTIVE_ONLY = ("maxIdle", "safetyPercent", "arrivalHalfLifeSeconds", "readyHalfLifeSamples")


class WarmPoolSpec(ApiModel):
    """How many idle runners to keep ready. fixed: scaling.minIdle. adaptive: enough to cover
    the jobs expected while a new runner boots, after Little's law (L = λW): ceil(arrival-rate
    EWMA * time-to-ready EWMA * safetyPercent/100), clamped to [minIdle, maxIdle]. In both modes
    an open schedules window replaces minIdle."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "self.mode != 'adaptive' || has(self.maxIdle)",
            "scaling.warmPool.maxIdle is required when scaling.warmPool.mode is adaptive",
            ".maxIdle",
        ),
        *[
            cel(
                f"self.mode == 'adaptive' || !has(self.{f})",
                f"scaling.warmPool.{f} is only used when scaling.warmPool.mode is adaptive",
                f".{f}",
            )
            for f in _ADAPTIVE_ONLY
        ],
    ]

    mode: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="fixed: keep scaling.minIdle idle runners (the default); adaptive: size the "
        "warm pool from the observed job arrival rate and runner time-to-ready.",
    )
    max_idle: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="adaptive: most idle runners the warm pool asks for (required).",
    )
    safety_percent: int | None = Field(
        default=None,
        ge=100,
        le=1000,
        description=f"adaptive: safety factor in percent on the Little's-law estimate "
        f"(default {DEFAULT_SAFETY_PERCENT}).",
    )
    arrival_half_life_seconds: int | None = Field(
        default=None,
        ge=10,
        le=86400,
        description=f"adaptive: half-life in seconds of the job arrival-rate EWMA "
        f"(default {DEFAULT_ARRIVAL_HALF_LIFE_SECONDS}).",
    )
    ready_half_life_samples: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description=f"adaptive: half-life in samples of the time-to-ready EWMA "
        f"(default {DEFAULT_READY_HALF_LIFE_SAMPLES}).",
    )
    schedules: list[WarmPoolSchedule] | None = Field(
        default=None,
        max_length=20,
        description="Windows with their own minIdle; when several are open the largest wins.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class ScalingSpec(ApiModel):
    """Lower and upper capacity limits and how demand is observed."""

    cel_rules: ClassVar[list[dict[str, Any]]] = [
        cel(
            "!has(self.minIdle) || !has(self.maxConcurrent) || self.minIdle <= self.maxConcurrent",
            "scaling.minIdle must be less than or equal to scaling.maxConcurrent",
            ".minIdle",
        ),
        cel(
            "!(self.mode in ['polling', 'hybrid']) || has(self.polling)",
            "scaling.polling is required when scaling.mode is polling or hybrid",
            ".polling",
        ),
        cel(
            "self.mode != 'polling' || !has(self.polling) || self.polling.enabled",
            "scaling.polling.enabled must be true when scaling.mode is polling (the pool would "
            "never see a job)",
            ".polling",
        ),
        cel(
            "!(self.mode in ['webhook', 'hybrid']) || "
            "(has(self.webhook) && has(self.webhook.secretRef))",
            "scaling.webhook.secretRef is required when scaling.mode is webhook or hybrid",
            ".webhook",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.maxIdle) || !has(self.minIdle) || "
            "self.warmPool.maxIdle >= self.minIdle",
            "scaling.warmPool.maxIdle must be greater than or equal to scaling.minIdle",
            ".warmPool.maxIdle",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.maxIdle) || !has(self.maxConcurrent) || "
            "self.warmPool.maxIdle <= self.maxConcurrent",
            "scaling.warmPool.maxIdle must be less than or equal to scaling.maxConcurrent",
            ".warmPool.maxIdle",
        ),
        cel(
            "!has(self.warmPool) || !has(self.warmPool.schedules) || !has(self.maxConcurrent) || "
            "self.warmPool.schedules.all(s, s.minIdle <= self.maxConcurrent)",
            "scaling.warmPool.schedules[].minIdle must be less than or equal to "
            "scaling.maxConcurrent",
            ".warmPool.schedules",
        ),
    ]

    mode: Literal["polling", "webhook", "hybrid", "manual"] = Field(
        default="manual",
        description="How pending jobs are observed: polling, webhook, hybrid (both), or manual "
        "(minIdle plus the imp.dev/runner-demand annotation only).",
    )
    min_idle: int | None = Field(
        default=None, ge=0, le=10000, description="Idle registered runners to keep ready."
    )
    max_concurrent: int | None = Field(
        default=None, ge=0, le=10000, description="Upper bound on the pool's VMs at once."
    )
    scale_up_step: int | None = Field(
        default=None, ge=1, le=10000, description="Most VMs created in one reconcile pass."
    )
    cooldown_seconds: int | None = Field(
        default=None,
        ge=0,
        le=86400,
        description="Seconds after a scale-up before surplus idle runners are removed.",
    )
    polling: PollingSpec | None = Field(default=None, description="Polling settings.")
    webhook: WebhookSpec | None = Field(default=None, description="Webhook settings.")
    warm_pool: WarmPoolSpec | None = Field(
        default=None,
        description="How many idle runners to keep ready (default: fixed, scaling.minIdle).",
    )


class ReaperSpec(ApiModel):
    """Removal of runners that outlive their job (after ARC's proposed runner reaper)."""

    enabled: bool = Field(default=False, description="Run the reaper for this pool.")
    max_job_seconds: int = Field(
        default=21600,
        ge=60,
        le=30 * 86400,
        description="A job running longer than this (seconds) has its runner removed.",
    )
    completed_grace_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Seconds a run/job must have been completed before its runner is removed.",
    )
    interval_seconds: int = Field(
        default=300, ge=10, le=86400, description="Seconds between reaper passes for this pool."
    )
    dry_run: bool = Field(default=False, description="Log 'would delete' and delete nothing.")
