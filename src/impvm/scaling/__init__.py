"""impvm.scaling: pure decisions on pool size, the warm pool's size, which VMs and registrations to
remove, and which pool a job belongs to. No I/O; see :mod:`impvm.scaling.poolpass` (the pool
pass), :mod:`impvm.scaling.warmpool` and :mod:`impvm.scaling.labels`."""

from impvm.scaling.labels import (
    DEFAULT_RUNNER_LABELS,
    PoolLabels,
    choose_pool,
    job_matches,
    normalise_labels,
)
from impvm.scaling.warmpool import (
    JobQueued,
    RunnerReady,
    WarmPoolDecision,
    WarmPoolPolicy,
    WarmPoolState,
    warm_pool_target,
)

__all__ = [
    "DEFAULT_RUNNER_LABELS",
    "JobQueued",
    "PoolLabels",
    "RunnerReady",
    "WarmPoolDecision",
    "WarmPoolPolicy",
    "WarmPoolState",
    "choose_pool",
    "job_matches",
    "normalise_labels",
    "warm_pool_target",
]
