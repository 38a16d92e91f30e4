"""The pool pass, pure: the shell (:mod:`impvm.operator.pool`) observes a :class:`PoolWorld`,
asks :func:`poll_first` whether to poll GitHub first, decides :func:`pool_acts`, carries the
acts out (:mod:`impvm.operator.execute`) and concludes :func:`conclude_pass`, which alone makes
the next :class:`~impvm.scaling.poolpass.memory.PoolMemory`. Nothing here does I/O.

Modules, in the order a pass uses them: :mod:`.world` and :mod:`.memory` (what is read),
:mod:`.poll` (phase 1), :mod:`.decide` (phase 2: the ladder) over :mod:`.lost`, :mod:`.warm`,
:mod:`.size` (:mod:`.sizing`, :mod:`.twoway`, :mod:`.scaledown`), :mod:`.starts` and
:mod:`.records`; :mod:`.acts` (the terms); :mod:`.conclude` over :mod:`.failures` and
:mod:`.status`.
"""

from impvm.scaling.poolpass.acts import (
    ActsDone,
    Deleted,
    DeleteVM,
    Deregistration,
    EventSpec,
    MintJit,
    PassConclusion,
    PatchVMStatus,
    PollRequest,
    PoolActs,
    ReleaseFinalizer,
    RemoveRegistration,
    Why,
)
from impvm.scaling.poolpass.conclude import CONDITION_TYPES, conclude_pass
from impvm.scaling.poolpass.decide import current_template_hash, made_from, pool_acts
from impvm.scaling.poolpass.failures import github_condition
from impvm.scaling.poolpass.lost import UNSCHEDULABLE_AFTER_SECONDS, waiting_for_a_node
from impvm.scaling.poolpass.memory import (
    BackoffState,
    PollState,
    PoolMemory,
    PoolRoute,
    StartFailures,
    WarmPoolMemory,
)
from impvm.scaling.poolpass.poll import poll_first, poll_since, poll_wanted
from impvm.scaling.poolpass.size import size_pool
from impvm.scaling.poolpass.sizing import (
    DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS,
    Counts,
    PoolLimits,
    Reason,
    RegistrationDeletion,
    SecretMint,
    Sizing,
    SizingFacts,
    VMDeletion,
    VMState,
    classify,
    parse_demand,
)
from impvm.scaling.poolpass.warm import warm_policy, warm_pool
from impvm.scaling.poolpass.world import (
    ClassObj,
    FailureKind,
    GitHubFailure,
    GitHubView,
    PollOutcome,
    PoolObj,
    PoolWorld,
    RateBudget,
    RunnerView,
    TemplateObj,
    VerifyKey,
)

__all__ = [
    "CONDITION_TYPES",
    "DEFAULT_BOOTSTRAP_TIMEOUT_SECONDS",
    "UNSCHEDULABLE_AFTER_SECONDS",
    "ActsDone",
    "BackoffState",
    "ClassObj",
    "Counts",
    "DeleteVM",
    "Deleted",
    "Deregistration",
    "EventSpec",
    "FailureKind",
    "GitHubFailure",
    "GitHubView",
    "MintJit",
    "PassConclusion",
    "PatchVMStatus",
    "PollOutcome",
    "PollRequest",
    "PollState",
    "PoolActs",
    "PoolLimits",
    "PoolMemory",
    "PoolObj",
    "PoolRoute",
    "PoolWorld",
    "RateBudget",
    "Reason",
    "RegistrationDeletion",
    "ReleaseFinalizer",
    "RemoveRegistration",
    "RunnerView",
    "SecretMint",
    "Sizing",
    "SizingFacts",
    "StartFailures",
    "TemplateObj",
    "VMDeletion",
    "VMState",
    "VerifyKey",
    "WarmPoolMemory",
    "Why",
    "classify",
    "conclude_pass",
    "current_template_hash",
    "github_condition",
    "made_from",
    "parse_demand",
    "poll_first",
    "poll_since",
    "poll_wanted",
    "pool_acts",
    "size_pool",
    "waiting_for_a_node",
    "warm_policy",
    "warm_pool",
]
