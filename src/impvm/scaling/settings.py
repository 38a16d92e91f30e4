"""The pool controller's tunables, stated once: ``impvm operator``'s options, the ``operator``
section of ``impvm up``'s configuration and the pool pass all read these models (seconds unless
a name says otherwise). Pure.

- :class:`OperatorTunables`: what a person sets (``--node-lost-grace-seconds`` on the command
  line, ``nodeLostGraceSeconds`` in ``impvm.yaml``), with its default and bounds;
- :class:`PassSettings`: those plus what only the code and the tests set (resync periods,
  backoff, how old a runner list may be, the start-failure backoff, the JIT mint budget).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from impvm.scaling.pollbudget import PollBudget

__all__ = ["OperatorTunables", "PassSettings", "VMPodSettings"]


class OperatorTunables(BaseModel):
    """The operator's tunables a person sets (camelCase in ``impvm.yaml``)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, validate_default=True
    )

    node_lost_grace_seconds: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds past an agent Lease's expiry before its node's VMs are given up "
        "(Failed, NodeLost).",
    )
    webhook_safety_poll_seconds: float = Field(
        default=300.0,
        ge=5,
        allow_inf_nan=False,
        description="Seconds between the polls of GitHub that webhook-mode pools make in case "
        "deliveries were lost.",
    )
    poll_calls_per_hour: float = Field(
        default=18000.0,
        ge=60,
        allow_inf_nan=False,
        description="Requests an hour the job poller of one GitHub installation may make, 304s "
        "included; it reads the repositories of all the installation's polling pools, busy "
        "ones every poll and the rest in turn (docs/architecture.md, Polling).",
    )
    poll_rate_limit_share: float = Field(
        default=0.5,
        ge=0.01,
        le=1,
        allow_inf_nan=False,
        description="Share of the installation's rate limit (GitHub's hourly window) the job "
        "poller may spend; JIT configs and runner listings use the rest.",
    )

    def options(self) -> list[str]:
        """These values as ``impvm operator`` options (``--node-lost-grace-seconds 60.0`` ...),
        one pair per field: how ``impvm up`` starts its operator with its configuration."""
        out: list[str] = []
        for name in OperatorTunables.model_fields:
            out += ["--" + name.replace("_", "-"), str(getattr(self, name))]
        return out

    def poll_budget(self) -> PollBudget:
        """The job poller's budget of one installation (:mod:`impvm.scaling.pollbudget`)."""
        return PollBudget(
            calls_per_hour=self.poll_calls_per_hour, rate_limit_share=self.poll_rate_limit_share
        )


class PassSettings(OperatorTunables):
    """Every tunable the pool pass reads: :class:`OperatorTunables` and the internal ones."""

    resync_seconds: float = 10.0
    busy_resync_seconds: float = 2.0
    template_missing_requeue_seconds: float = 30.0
    #: below this share of the rate-limit budget, polling (non-essential) pauses; JIT minting
    #: (essential) goes on
    poll_budget_floor: float = 0.2
    #: backoff of a pool's GitHub work after a failure: base * 2**(n-1), at most cap
    backoff_base_seconds: float = 2.0
    backoff_cap_seconds: float = 300.0
    #: the oldest runner list a pool decides from while a VM awaits its runner, and otherwise;
    #: how long a new VM counts as awaiting it (:mod:`impvm.scaling.runnerlist`)
    awaiting_runner_list_seconds: float = 0.5
    idle_runner_list_seconds: float = 60.0
    runner_wait_fresh_seconds: float = 60.0
    #: after n VMs in a row failed at start, the next is made base * 2**(n-1) s after the last
    #: failure, at most cap (ARC backs its EphemeralRunners off 5, 10, 20, 40, 80 s)
    start_failure_backoff_seconds: float = 5.0
    start_failure_backoff_cap_seconds: float = 300.0
    #: JIT configs an installation may mint a minute (GitHub's secondary rate limit: about 80
    #: content-creating requests a minute, REST "Rate limits for the REST API") and the share
    #: of them one pool may take while other pools of the installation exist
    installation_mints_per_minute: int = 80
    pool_mint_share: float = 0.5


class VMPodSettings(BaseModel):
    """What every VM pod (:mod:`impvm.scaling.vmpods`) is made with: ``impvm operator
    --vm-pods FILE``, a JSON file the chart renders from its ``vmPods`` and ``agent`` values
    (camelCase keys; unknown keys are refused). Without it the operator places VMs itself
    (:mod:`impvm.scaling.placement`), as ``impvm up`` does."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid"
    )

    image: str = Field(min_length=1, max_length=1024, description="The pod's image.")
    owner_config_map: str = Field(
        default="impvm-vm-pods",
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The ConfigMap in the installation's namespace that controls every VM pod "
        "(the chart's, holding this file): only pods it controls are VM pods, and they go with "
        "it.",
    )
    command: tuple[str, ...] = Field(
        default=("sleep", "infinity"),
        max_length=16,
        description="What it runs: nothing that uses the resources it holds.",
    )
    overhead_mib: int = Field(
        default=128,
        alias="overheadMiB",
        ge=0,
        le=65536,
        description="MiB requested beyond the guest memory: QEMU's own (its code, device "
        "state, TCG's translation cache).",
    )
    milli_cpu_per_vcpu: int = Field(
        default=1000,
        alias="milliCPUPerVCPU",
        ge=10,
        le=1000,
        description="CPU requested per vCPU, in millicores: 1000 counts each vCPU as a core; "
        "less lets VMs' vCPUs share cores (KubeVirt's cpuAllocationRatio 10 is 100).",
    )
    node_selectors: tuple[dict[str, str], ...] = Field(
        default=(),
        max_length=64,
        description="The VM node pools' node selectors: a VM pod goes to a node matching one "
        "of them (empty: any node).",
    )
    tolerations: tuple[dict[str, str | int], ...] = Field(
        default=(), max_length=64, description="Taints every VM pod tolerates (the node pools')."
    )
    priority_class_name: str = Field(default="", max_length=253)
    image_pull_secrets: tuple[str, ...] = Field(default=(), max_length=16)
    run_as_user: int = Field(default=65534, ge=1, le=2**31 - 1)
