"""impvm.scaling: pure decisions on pool size, which VMs and registrations to remove, and which
pool a job belongs to. No I/O; see :mod:`impvm.scaling.pool` and :mod:`impvm.scaling.labels`."""

from impvm.scaling.labels import (
    DEFAULT_RUNNER_LABELS,
    PoolKey,
    choose_pool,
    demand_by_pool,
    job_matches,
    normalise_labels,
)
from impvm.scaling.pool import (
    DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS,
    Counts,
    PoolLimits,
    PoolSnapshot,
    Reason,
    RegistrationDeletion,
    RunnerView,
    ScalePlan,
    SecretMint,
    VMDeletion,
    VMState,
    VMView,
    classify,
    decide,
    parse_demand,
)

__all__ = [
    "DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS",
    "DEFAULT_RUNNER_LABELS",
    "Counts",
    "PoolKey",
    "PoolLimits",
    "PoolSnapshot",
    "Reason",
    "RegistrationDeletion",
    "RunnerView",
    "ScalePlan",
    "SecretMint",
    "VMDeletion",
    "VMState",
    "VMView",
    "choose_pool",
    "classify",
    "decide",
    "demand_by_pool",
    "job_matches",
    "normalise_labels",
    "parse_demand",
]
